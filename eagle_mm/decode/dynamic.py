"""Tree verification over HF's ``DynamicCache``: what ``autotree_costs`` times a verify with.

The decode loop runs the engine's one storage (``storage.py``); this keeps only the slot book-keeping the tree
calibration's cost probe uses.

Slots: a full-attention layer stores a sequence of slots; ``SlotBook.full`` (B, S) holds each slot's
token position, -1 where a row has no token (left padding, or the holes left when rows accept
different counts). A sliding-window layer stores at most ``window - 1`` slots per row, compacted to the
right after every cycle; ``SlotBook.windows[w]`` (B, s) holds their positions. HF stores a
chunked-attention layer (Llama 4) as a sliding-window layer of window = chunk size, book-kept the same
way. After a verify forward the Q tree slots sit at the end of every layer; ``keep_path`` keeps the
accepted ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SlotBook", "CacheSnapshot", "keep_path"]


@dataclass
class SlotBook:
    full: torch.Tensor  # (B, S) positions of full-layer slots, -1 unused
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> (B, s) positions

    @classmethod
    def after_prefill(cls, cache, pos: torch.Tensor) -> "SlotBook":
        book = cls(full=pos)
        for layer in cache.layers:
            if _is_sliding(layer):
                book.windows[layer.sliding_window] = pos[:, pos.shape[1] - _stored_len(layer):]
        return book

    def by_window(self) -> dict:
        """{None: full slots, window: that window's slots}, as ``tree_masks`` takes them."""
        return {None: self.full, **self.windows}


def _is_sliding(layer) -> bool:
    return bool(getattr(layer, "is_sliding", False))


def _stored_len(layer) -> int:
    return 0 if getattr(layer, "keys", None) is None or layer.keys.numel() == 0 else layer.keys.shape[-2]


class CacheSnapshot:
    """Stored lengths before a verify forward; sliding layers are told to keep every slot until
    ``keep_path`` compacts them (otherwise a tree wider than the window would lose its own slots)."""

    def __init__(self, cache, q_len: int):
        self.lengths = [_stored_len(layer) for layer in cache.layers]
        for layer in cache.layers:
            if not _is_sliding(layer):
                continue
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
            elif q_len > layer.sliding_window - 1:
                raise ValueError(f"a tree of {q_len} tokens does not fit the sliding window {layer.sliding_window} "
                                 f"on this transformers release; use total_tokens < {layer.sliding_window - 1}")


def _compact_index(pos: torch.Tensor, width: int):
    """Per row, the indices of the last ``width`` valid slots, right-aligned: (B, w) idx and their pos."""
    valid = pos >= 0
    # Width from shapes only (no host read): rows with fewer valid slots get -1 padding, which masks hide.
    w = min(width, pos.shape[1])
    # Score valid slots by index, invalid ones below all: top-w then ascending order keeps the newest w.
    score = torch.where(valid, torch.arange(pos.shape[1], device=pos.device).expand_as(pos), -1)
    top = score.topk(w, dim=1).values.flip(1)  # (B, w) ascending, -1 padding on the left
    idx = top.clamp(min=0)
    return idx, torch.where(top >= 0, pos.gather(1, idx), torch.full_like(idx, -1))


def _gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (B, h, S, d), idx (B, A) -> (B, h, A, d)."""
    i = idx.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
    return t.gather(2, i)


def keep_path(cache, snap: CacheSnapshot, book: SlotBook, keep: torch.Tensor, new_pos: torch.Tensor,
              q_len: int) -> None:
    """Replace the Q tree slots appended by the last forward with the kept ones.

    keep (B, A) indices into the tree slots; new_pos (B, A) their positions, -1 for padding.
    """
    compact = {}
    for w, old_pos in book.windows.items():
        compact[w] = _compact_index(torch.cat((old_pos, new_pos), 1), w - 1)
    for layer, s_old in zip(cache.layers, snap.lengths):
        if getattr(layer, "keys", None) is None:
            continue
        k, v = layer.keys, layer.values  # (B, h, s_old + Q, d)
        k = torch.cat((k[:, :, :s_old], _gather_slots(k[:, :, -q_len:], keep)), 2)
        v = torch.cat((v[:, :, :s_old], _gather_slots(v[:, :, -q_len:], keep)), 2)
        if _is_sliding(layer):
            idx = compact[layer.sliding_window][0]
            k, v = _gather_slots(k, idx), _gather_slots(v, idx)
            layer.cumulative_length = layer.cumulative_length - q_len + keep.shape[1]
        layer.keys, layer.values = k, v
    book.full = torch.cat((book.full, new_pos), 1)
    for w in book.windows:
        book.windows[w] = compact[w][1]
