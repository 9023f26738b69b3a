"""Attention layer kinds and the one tree-mask builder.

A forward of Q new tokens (a verify tree, or a prefill chain) attends to the S stored slots of a layer and to
itself. Each slot has a token position (-1: empty, left padding, or a hole left where a row accepted fewer tokens
than another). The engine's storage writes the new tokens into slots it already holds (``write``); the tree
calibration's cost probe (``autotree_costs``, over HF's ``DynamicCache``) appends them after the stored ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayerKind", "layer_kinds", "tree_masks"]


@dataclass(frozen=True)
class LayerKind:
    name: str  # the model's layer_types name, used as the mask-dict key
    window: int | None = None  # sliding window: key allowed when q_pos - k_pos < window
    chunk: int | None = None  # chunked attention: key allowed when in the same chunk as the query


def layer_kinds(text_config, num_layers: int, cache_layers=None) -> list[LayerKind]:
    """The attention kind of each decoder layer.

    From the config alone for the engine (it stores every layer in full); with a ``DynamicCache``'s
    ``cache_layers`` (the tree calibration's cost probe), a layer HF stores as a sliding cache layer keeps its
    window there (HF stores a chunked layer (Llama 4) as a sliding layer of window = chunk size, whose slots are
    book-kept like a window's).
    """
    types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    chunk = getattr(text_config, "attention_chunk_size", None)
    kinds = []
    for i in range(num_layers):
        layer = cache_layers[i] if cache_layers is not None else None
        stored_window = layer.sliding_window if getattr(layer, "is_sliding", False) else None
        if types is not None:
            name = types[i]
        else:
            sliding = stored_window if cache_layers is not None else window
            name = "sliding_attention" if sliding else "full_attention"
        if name == "full_attention":
            kinds.append(LayerKind(name))
        elif name == "sliding_attention" and (stored_window or window):
            kinds.append(LayerKind(name, window=stored_window or window))
        elif name == "chunked_attention" and chunk:
            kinds.append(LayerKind(name, window=stored_window, chunk=chunk))
        else:
            raise ValueError(f"layer {i} has attention type {name!r}, which tree verification does not support")
    return kinds


def tree_masks(kinds: list[LayerKind], slot_pos, q_pos: torch.Tensor, q_allowed: torch.Tensor,
               dtype: torch.dtype, write: torch.Tensor | None = None):
    """Additive float masks for Q new tokens over the stored slots.

    slot_pos: (B, S) positions of the stored slots, or a dict {window: (B, s)} beside key None for the full layers
    (a ``DynamicCache`` keeps sliding layers compacted); q_pos (B, Q) the new tokens' positions; q_allowed (B, Q, Q)
    bool, which new tokens each may see (tree ancestry, or causal). ``write`` (Q,): the slots the new tokens are
    written to (the engine; their stored positions must be -1 until then), else they are appended after the S slots.
    Returns one (B, 1, Q, S or S+Q) tensor, or a dict by layer type when the model mixes kinds.
    """
    neg = torch.finfo(dtype).min
    B, Q = q_pos.shape
    masks = {}
    for kind in kinds:
        if kind.name in masks:
            continue
        kpos = slot_pos.get(kind.window if kind.window is not None else None) if isinstance(slot_pos, dict) \
            else slot_pos
        qp, kp = q_pos[:, :, None], kpos[:, None, :]  # (B, Q, 1), (B, 1, S)
        past_ok = (kp >= 0) & (kp <= qp)
        new_ok = q_allowed
        if kind.window is not None:  # the new tokens too: a prefill chain can be longer than the window
            past_ok = past_ok & (qp - kp < kind.window)
            new_ok = new_ok & (qp - q_pos[:, None, :] < kind.window)
        if kind.chunk is not None:
            qc = torch.div(q_pos, kind.chunk, rounding_mode="floor")
            past_ok = past_ok & (qc[:, :, None] == torch.div(kp, kind.chunk, rounding_mode="floor"))
            new_ok = new_ok & (qc[:, :, None] == qc[:, None, :])
        if write is None:
            allowed = torch.cat((past_ok, new_ok), dim=-1)  # (B, Q, S+Q)
        else:
            allowed = past_ok.scatter(2, write[None, None, :].expand(B, Q, Q), new_ok)  # (B, Q, S)
        m = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill_(~allowed, neg)
        masks[kind.name] = m[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks
