"""Attention layer kinds and the one tree-mask builder.

A forward of Q new tokens (a verify tree, or a prefill chain) attends to the S stored slots of a layer and to
itself. Each slot has a token position (-1: empty, left padding, or a hole left where a row accepted fewer tokens
than another). The engine's storage writes the new tokens into slots it already holds (``write``). Every layer is
stored in full: a sliding-window or chunked layer's rule is the mask's.
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


def layer_kinds(text_config, num_layers: int) -> list[LayerKind]:
    """The attention kind of each decoder layer, from the target's text config."""
    types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    chunk = getattr(text_config, "attention_chunk_size", None)
    kinds = []
    for i in range(num_layers):
        name = types[i] if types is not None else "sliding_attention" if window else "full_attention"
        if name == "full_attention":
            kinds.append(LayerKind(name))
        elif name == "sliding_attention" and window:
            kinds.append(LayerKind(name, window=window))
        elif name == "chunked_attention" and chunk:
            kinds.append(LayerKind(name, chunk=chunk))
        else:
            raise ValueError(f"layer {i} has attention type {name!r}, which tree verification does not support")
    return kinds


def tree_masks(kinds: list[LayerKind], slot_pos: torch.Tensor, q_pos: torch.Tensor, q_allowed: torch.Tensor,
               dtype: torch.dtype, write: torch.Tensor):
    """Additive float masks for Q new tokens over the stored slots.

    slot_pos (B, S) positions of the stored slots; q_pos (B, Q) the new tokens' positions; q_allowed (B, Q, Q) bool,
    which new tokens each may see (tree ancestry, or causal); ``write`` (Q,) the slots the new tokens are written to
    (their stored positions must be -1 until then). Returns one (B, 1, Q, S) tensor, or a dict by layer type when the
    model mixes kinds.
    """
    neg = torch.finfo(dtype).min
    B, Q = q_pos.shape
    masks = {}
    for kind in kinds:
        if kind.name in masks:
            continue
        qp, kp = q_pos[:, :, None], slot_pos[:, None, :]  # (B, Q, 1), (B, 1, S)
        past_ok = (kp >= 0) & (kp <= qp)
        new_ok = q_allowed
        if kind.window is not None:  # the new tokens too: a prefill chain can be longer than the window
            past_ok = past_ok & (qp - kp < kind.window)
            new_ok = new_ok & (qp - q_pos[:, None, :] < kind.window)
        if kind.chunk is not None:
            qc = torch.div(q_pos, kind.chunk, rounding_mode="floor")
            past_ok = past_ok & (qc[:, :, None] == torch.div(kp, kind.chunk, rounding_mode="floor"))
            new_ok = new_ok & (qc[:, :, None] == qc[:, None, :])
        allowed = past_ok.scatter(2, write[None, None, :].expand(B, Q, Q), new_ok)  # (B, Q, S)
        m = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill_(~allowed, neg)
        masks[kind.name] = m[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks
