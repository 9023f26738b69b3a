"""The fallback storage: HF's ``DynamicCache``, shapes that follow the cache, every step eager.

For what the engine's fixed storage (``fixed.py``) cannot hold yet, or when asked for
(``cache_implementation="dynamic"``). Same interface and the same step pieces as the engine (``draft_candidates``,
``tree_masks``, ``committed``, ``head_entries``); what differs is only where slots live.

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

from ..target.compat import cache_kwarg, output_cache
from .accept import accept, committed
from .draft import HeadCache, bonus_entry, draft_tree, extend_head, scratch_slots
from .masks import layer_kinds, tree_masks
from .sampling import draft_noise
from .tree import Tree, ancestors

__all__ = ["DynamicStorage", "SlotBook", "CacheSnapshot", "keep_path"]


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


class DynamicStorage:
    """The fallback's state for one call: the HF cache and its slot book, the head's growing cache and the root.

    ``update`` reads the accept lengths to the host itself (it keeps only as many slots as the longest path
    needs), so ``read`` hands back what it read."""

    setup = 0.0  # nothing is compiled or captured
    compacts, pow2 = True, False  # finished rows are dropped (``compact``), to the live rows exactly

    def __init__(self, model, head, parts, tree, sampler=None):
        self.model, self.head, self.parts, self.tree, self.sampler = model, head, parts, tree, sampler
        self._cache_kwarg = cache_kwarg(model)

    @property
    def cur(self) -> int:
        return self.book.full.shape[1]

    def prefill(self, cap, input_ids, slot_pos, position_ids, extra: dict | None):
        mask = (slot_pos >= 0).long()
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, **(extra or {}),
                         use_cache=True, logits_to_keep=1)
        self.cache = output_cache(out)
        self.kinds = layer_kinds(self.parts.text_config, len(self.cache.layers), self.cache.layers)
        self.book = SlotBook.after_prefill(self.cache, slot_pos)
        return out.logits[:, -1], cap.features(), input_ids, slot_pos

    def start(self, hcache: HeadCache, root, root_pos, root_out, root_logits) -> None:
        self.head_cache, self.root, self.root_pos, self.root_out, self.root_logits = (hcache, root, root_pos,
                                                                                      root_out, root_logits)

    def set_tree(self, tree) -> None:
        """Draft ``tree`` from the next cycle on."""
        self.tree = tree

    def draft(self):
        t, s = self.tree, self.sampler
        if not t.drafts:  # the root alone (``TreeConfig.none()``)
            zero = torch.zeros_like(self.root)[:, None]
            q_nodes = None if s is None else torch.zeros(*zero.shape, s.vocab_size, device=zero.device)
            return Tree(self.root[:, None], zero, zero), self.root_pos[:, None], q_nodes
        noise = None
        if s is not None:  # the same draws, in the same order, as the engine's
            noise = draft_noise(torch.empty(self.root.shape[0], 1 + scratch_slots(t.top_k, t.depth), s.width,
                                            device=self.root.device), s.generator)
        tree, q_nodes = draft_tree(self.head, self.head_cache, self.root, self.root_out, self.root_logits,
                                   self.root_pos, t, s, noise)
        return tree, self.root_pos[:, None] + tree.depth, q_nodes

    def verify(self, cap, tree: Tree, q_pos: torch.Tensor, positions: torch.Tensor):
        masks = tree_masks(self.kinds, self.book.by_window(), q_pos, ancestors(tree.parent, self.tree.depth),
                           self.model.dtype)
        self._snap = CacheSnapshot(self.cache, tree.size)
        logits = self.model(input_ids=tree.tokens, attention_mask=masks, position_ids=positions,
                            **{self._cache_kwarg: self.cache}, use_cache=True).logits
        return logits, cap.features()

    def accept(self, tree: Tree, logits, q_nodes, processors, rows: list, depth: int, generator):
        return accept(tree, logits, q_nodes, processors, rows, depth, generator)

    def update(self, tokens, q_pos, feats, accept_len, path, bonus) -> torch.Tensor:
        new_tok, new_pos = committed(tokens, q_pos, accept_len, path, bonus)  # (B, D+1) each
        packed = torch.cat((accept_len[:, None], new_tok), 1).cpu()  # this path's one host read
        A = int(packed[:, 0].max()) + 1  # keep root + accepted nodes: A slots for every row, shorter paths padded
        keep, new_pos = path[:, :A], new_pos[:, :A]
        keep_path(self.cache, self._snap, self.book, keep, new_pos, tokens.shape[1])
        if not self.tree.drafts:  # no draft: the head is left as it is (``steps.advance_step`` says why)
            self.root, self.root_pos = bonus.squeeze(1), self.root_pos + 1
            return packed
        # Head: entries pairing each kept node's true feature with the next committed token.
        hidden = feats.gather(1, keep[:, :, None].expand(-1, -1, feats.shape[-1]))
        self.head_cache, h_out, h_logits = extend_head(self.head, self.head_cache, hidden, new_tok[:, :A], new_pos)
        self.root_out, self.root_logits = bonus_entry(h_out, h_logits, accept_len)
        self.root = bonus.squeeze(1)
        self.root_pos = self.root_pos + accept_len + 1
        return packed

    def read(self, packed: torch.Tensor) -> torch.Tensor:
        return packed

    def compact(self, keep: list[int]) -> None:
        """Go on with the rows ``keep`` only (``rows.plan``), in that order."""
        idx = torch.tensor(keep, device=self.root.device)
        self.cache.batch_select_indices(idx)
        self.book.full = self.book.full[idx]
        self.book.windows = {w: p[idx] for w, p in self.book.windows.items()}
        h = self.head_cache
        self.head_cache = HeadCache(h.k[idx], h.v[idx], h.pos[idx], h.length, h.scratch)
        self.root, self.root_pos, self.root_out, self.root_logits = (
            t[idx] for t in (self.root, self.root_pos, self.root_out, self.root_logits))

    def advance(self, n: int) -> None:
        """Nothing to move: the cache grew in ``update``."""
