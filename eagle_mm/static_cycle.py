"""The static-cache decode cycle as two fixed-shape functions around the verify forward, one graph each.

With ``cache_implementation="static"`` a cycle runs
  ``draft_step``   grow the EAGLE-2 frontier ``depth`` levels (the head's step inlined, its scratch-slot
                   writes included), the global rerank, and the verify positions;
  verify           the target's forward over the tree (``StaticTarget.verify``) and the acceptance
                   (``generate._cycle``: the greedy kernel or rejection sampling);
  ``update_step``  keep the accepted path in the target's cache, run the head on the new committed entries
                   and write them to its cache, set the next root, and pack the accept lengths and new tokens
                   for the cycle's one host read.
Launched op by op from Python, the draft and the update are ~900 aten calls per cycle (depth 5, top-k 8, views
included), which cost more host time than the verify's GPU time on an 8B target
(bench/results/bench_8b_h200_2026-11-29.json: 14-15 ms per cycle around a 7.5 ms verify); compiled with
``mode="reduce-overhead"`` each function is one CUDA-graph replay (``graphs.OwnGraph``).

Everything the functions carry from one cycle to the next lives in ``CycleBuffers``: allocated once per
(head, shape), reused by later calls, and marked as static addresses. That is what lets a CUDA graph write
them in place: ``OwnGraph`` copies every unmarked argument into the graph's own buffer (a write to it would
be lost), and inductor's graph trees run a graph that mutates an input of unmarked address without CUDA
graphs ("skipping cudagraphs due to mutated inputs"), which ``static.compiled`` turns into a warning. No
output of a graph is read after that graph runs again (its memory is reused): the draft returns nothing, its
tree lives in the buffers, the verify's logits and features are read before the next verify, and the
update's one output is read right away. The functions take tensors and per-call
constants (top_k, depth, total) only, so they compile once and replay every cycle and every call of the same
shapes. Sampling mode drafts on the eager path (its Gumbel draws take a ``torch.Generator``, which dynamo does
not trace) with the compiled head step, and shares ``update_step``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

import torch

from .config import TreeConfig
from .draft import HeadCache, draft_candidates, head_entries
from . import static
from .static import StaticTarget, compiled, keep_slots
from .tree import Tree, select_tree

__all__ = ["CycleBuffers", "StaticCycle", "draft_step", "update_step"]


@dataclass
class CycleBuffers:
    """The static path's state between cycles, at fixed addresses (all marked static)."""

    head_k: torch.Tensor  # (B, nkv, C + S, hd) the head's cache: C committed slots, then S draft scratch slots
    head_v: torch.Tensor  # (B, nkv, C + S, hd_v)
    head_pos: torch.Tensor  # (B, C) position of each committed head slot, -1 empty
    cur: torch.Tensor  # () committed slots so far, in the target's cache and the head's alike
    root: torch.Tensor  # (B,) last committed token, not yet in the target cache
    root_pos: torch.Tensor  # (B,)
    root_out: torch.Tensor  # (B, H) head output at the entry pairing the previous feature with the root
    root_logits: torch.Tensor  # (B, V_draft) fp32
    tokens: torch.Tensor  # (B, Q) the cycle's tree, root first (greedy; sampling drafts on the eager path)
    parent: torch.Tensor  # (B, Q)
    depth: torch.Tensor  # (B, Q)
    q_pos: torch.Tensor  # (B, Q) positions of the tree nodes

    @classmethod
    def like(cls, hcache: HeadCache, root_out: torch.Tensor, root_logits: torch.Tensor, capacity: int,
             scratch: int, q_len: int) -> "CycleBuffers":
        """Zeroed buffers for a prefill's (dynamic) head cache and root outputs, marked as static addresses."""
        B, nkv, _, hd = hcache.k.shape
        n, idx = capacity + scratch, dict(dtype=torch.long, device=hcache.k.device)
        buf = cls(hcache.k.new_zeros(B, nkv, n, hd), hcache.v.new_zeros(B, nkv, n, hcache.v.shape[-1]),
                  torch.zeros(B, capacity, **idx), torch.zeros((), **idx), torch.zeros(B, **idx),
                  torch.zeros(B, **idx), root_out.new_zeros(B, root_out.shape[-1]),
                  root_logits.new_zeros(B, root_logits.shape[-1]), *(torch.zeros(B, q_len, **idx) for _ in range(4)))
        for f in fields(buf):
            torch._dynamo.mark_static_address(getattr(buf, f.name))
        return buf


# One set of buffers per head, kept between calls (the compiled graphs are bound to their addresses): (key, buf).
_BUFFERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class StaticCycle:
    """One call's static path: its buffers and the draft and update functions (compiled with ``mode``, or eager).

    The host keeps its own write pointers (``StaticTarget.cur``, ``HeadCache.length``) for the room checks and
    the sampling path; ``advance`` moves them on after the host read, as ``update_step`` moved the device's.
    """

    def __init__(self, head, target: StaticTarget, tree: TreeConfig, mode: str | None):
        self.head, self.target, self.tree = head, target, tree
        graphs = dict(fullgraph=True, own_graphs=static.OWN_GRAPHS)
        self._draft = compiled(head, "draft", draft_step, mode, **graphs) if mode else draft_step
        self._update = compiled(head, "update", update_step, mode, **graphs) if mode else update_step
        self.buf: CycleBuffers | None = None
        self.head_cache: HeadCache | None = None
        self._next: tuple[Tree, torch.Tensor] | None = None  # the next cycle's draft, launched ahead by ``read``
        self._host: torch.Tensor | None = None  # pinned (B, 1 + D+1) on CUDA: where the host read lands
        self._read_done = None  # a CUDA event recorded after the read's copy
        self._layers: tuple[list, list, list] = ([], [], [])  # the target cache's keys, values, write pointers

    def start(self, hcache: HeadCache, root: torch.Tensor, root_pos: torch.Tensor, root_out: torch.Tensor,
              root_logits: torch.Tensor) -> HeadCache:
        """Copy the prefill's head cache (dynamic, S entries) and root into the buffers; returns the static
        head cache over them (``self.buf`` holds the root)."""
        t = self.tree
        capacity, scratch, q_len = self.target.length, (t.depth - 1) * t.top_k, t.total_tokens + 1
        S = hcache.k.shape[2]
        if S != self.target.cur:
            raise ValueError(f"head cache of {S} entries does not match the target's {self.target.cur} prefilled slots")
        key = (tuple(hcache.k.shape[:2]), hcache.k.shape[3], hcache.v.shape[3], capacity, scratch, q_len,
               root_out.shape[-1], root_logits.shape[-1], hcache.k.dtype, root_out.dtype, root_logits.dtype,
               hcache.k.device)
        old_key, buf = _BUFFERS.get(self.head, (None, None))
        if old_key != key:
            buf = CycleBuffers.like(hcache, root_out, root_logits, capacity, scratch, q_len)
            _BUFFERS[self.head] = (key, buf)  # one live set per head: a new shape frees the old one
        buf.head_k.zero_()
        buf.head_v.zero_()
        buf.head_k[:, :, :S], buf.head_v[:, :, :S] = hcache.k, hcache.v
        buf.head_pos.fill_(-1)
        buf.head_pos[:, :S] = hcache.pos
        buf.cur.fill_(S)
        for dst, src in ((buf.root, root), (buf.root_pos, root_pos), (buf.root_out, root_out),
                         (buf.root_logits, root_logits)):
            dst.copy_(src)
        self.buf, self.head_cache = buf, HeadCache(buf.head_k, buf.head_v, buf.head_pos, S, scratch)
        self._layers = self.target.layers()  # the target cache's tensors: fixed for the call (prefilled by now)
        return self.head_cache

    def draft(self) -> tuple[Tree, torch.Tensor]:
        """This cycle's greedy tree: the one ``read`` launched ahead, or drafted now from the buffered root.
        Returns (Tree (B, Q) in the buffers, q_pos (B, Q))."""
        if self._next is not None:
            ahead, self._next = self._next, None
            return ahead
        return self._launch_draft()

    def read(self, packed: torch.Tensor, draft_ahead: bool) -> torch.Tensor:
        """The cycle's one host read of ``update``'s output (B, 1 + D+1); with ``draft_ahead`` (greedy, on CUDA)
        the next cycle's draft is launched behind the copy, so the GPU drafts while the host commits.

        The draft reads only what ``update`` just wrote on the device (the next root, the head's cache), so it is
        the next cycle's draft whatever the host then decides; when decoding stops there, it goes unused. The
        copy is queued before the draft, so the draft's graph cannot reuse ``packed``'s memory before it is read.
        """
        if not (draft_ahead and packed.is_cuda):
            return packed.cpu()
        if self._host is None or self._host.shape != packed.shape or self._host.dtype != packed.dtype:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._read_done = torch.cuda.Event()
        self._host.copy_(packed, non_blocking=True)
        self._read_done.record()
        self._next = self._launch_draft()
        self._read_done.synchronize()  # waits for the copy only, not for the draft queued after it
        return self._host

    def _launch_draft(self) -> tuple[Tree, torch.Tensor]:
        b, t = self.buf, self.tree
        self._draft(self.head, b.head_k, b.head_v, b.head_pos, b.root, b.root_pos, b.root_out, b.root_logits,
                    b.tokens, b.parent, b.depth, b.q_pos, t.top_k, t.depth, t.total_tokens)
        return Tree(b.tokens, b.parent, b.depth), b.q_pos

    def update(self, tokens: torch.Tensor, q_pos: torch.Tensor, feats: torch.Tensor, accept_len: torch.Tensor,
               path: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """Keep the accepted paths, extend the head, set the next root (``update_step``); returns the device
        tensor (B, 1 + D+1) of accept lengths and new tokens for the cycle's host read."""
        K = path.shape[1]
        if self.target.cur + K > self.target.length:
            raise RuntimeError(f"static cache of {self.target.length} slots is full ({self.target.cur} used, "
                               f"a path needs {K})")
        b = self.buf
        keys, values, lengths = self._layers
        return self._update(self.head, keys, values, lengths, self.target.pos, b.head_k, b.head_v, b.head_pos, b.cur,
                            b.root, b.root_pos, b.root_out, b.root_logits, tokens, q_pos, feats, accept_len, path,
                            bonus)

    def advance(self, n: int) -> None:
        """The host's copies of the write pointers move on ``n`` slots (the longest accepted path + 1)."""
        self.target.cur += n
        self.head_cache.length += n


def draft_step(head, head_k, head_v, head_pos, root, root_pos, root_out, root_logits, tokens, parent, depth_out,
               q_pos, top_k: int, depth: int, total: int) -> None:
    """Grow the greedy EAGLE-2 tree below the root and rerank it; write it to tokens, parent, depth, q_pos (B, Q).

    Reads the head's committed slots and writes its scratch slots (``draft_candidates``); nothing else changes.
    """
    # length 0: the draft never reads the committed length (the mask hides empty slots), only the scratch size.
    cache = HeadCache(head_k, head_v, head_pos, 0, head_k.shape[2] - head_pos.shape[1])
    c = draft_candidates(head, cache, root_out, root_logits, root_pos, top_k, depth)
    tree = select_tree(root, c.tokens, c.parent, c.depth, c.score, total)
    tokens.copy_(tree.tokens)
    parent.copy_(tree.parent)
    depth_out.copy_(tree.depth)
    q_pos.copy_(root_pos[:, None] + tree.depth)


def update_step(head, keys: list, values: list, lengths: list, target_pos, head_k, head_v, head_pos, cur, root,
                root_pos, root_out, root_logits, tokens, q_pos, feats, accept_len, path, bonus) -> torch.Tensor:
    """After the acceptance: keep the accepted path, extend the head, set the next root, all in place.

    tokens, q_pos (B, Q) the verified tree; feats (B, Q, F) the target's features at its nodes; accept_len (B,);
    path (B, K) node indices from the root (K = D+1, padded past accept_len); bonus (B, 1). Every row writes K
    slots at [cur, cur+K) of both caches and the pointer moves on by the longest path + 1: a row's slots past
    its own path get position -1, padding the next cycle overwrites. Returns (B, 1+K): the accept length,
    then the new tokens (path nodes 1..a, the bonus at column a) for the host.
    """
    K = path.shape[1]
    j = torch.arange(K, device=path.device)  # (K,)
    path_next = torch.cat((tokens.gather(1, path[:, 1:]), bonus), 1)  # (B, K)
    new_tok = torch.where(j == accept_len[:, None], bonus, path_next)  # (B, K)
    new_pos = torch.where(j <= accept_len[:, None], q_pos.gather(1, path), -1)  # (B, K)
    advance = accept_len.max() + 1  # () on the device: a host value here would be a sync (and a recompile)
    dst = cur + j  # (K,) slots [cur, cur+K)
    keep_slots(keys, values, lengths, path + cur, dst, cur + advance)  # the verify wrote node i at slot cur+i
    target_pos.index_copy_(1, dst, new_pos)
    # The head: entries pairing each kept node's true feature with the next committed token.
    hidden = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))  # (B, K, F)
    cache = HeadCache(head_k, head_v, head_pos, 0, head_k.shape[2] - head_pos.shape[1])
    out, logits, (k, v) = head_entries(head, cache, hidden, new_tok, new_pos)  # (B, K, H), (B, K, V_draft)
    head_k.index_copy_(2, dst, k)
    head_v.index_copy_(2, dst, v)
    head_pos.index_copy_(1, dst, new_pos)
    last = accept_len[:, None, None]  # column of the bonus entry
    root_out.copy_(out.gather(1, last.expand(-1, -1, out.shape[-1])).squeeze(1))
    root_logits.copy_(logits.gather(1, last.expand(-1, -1, logits.shape[-1])).squeeze(1))
    root.copy_(bonus.squeeze(1))
    root_pos.add_(accept_len + 1)
    cur.add_(advance)
    return torch.cat((accept_len[:, None], new_tok), 1)
