"""The engine's one storage: fixed-address buffers and fixed shapes, so that each step of the cycle can run as a
CUDA graph (``runner.py``), and the same buffers eagerly wherever graphs cannot run.

Every cycle runs the same shapes: the tree always has ``total_tokens + 1`` nodes (``select_tree`` keeps exactly that
many), the target's KV cache is an HF ``Cache`` of static layers of a fixed length L (``hf/cache.py``), the
verify mask is (B, 1, Q, L), the kept path is always written as D+1 slots (those past the accepted length are padding
that the next cycle overwrites), and the head's cache is a fixed buffer with scratch slots for the draft steps.
Sliding-window and chunked layers are stored in full; the mask applies their rule. The head's slots follow the
target's one for one.

Slots: ``pos`` (B, L) holds the token position in each target cache slot, -1 where empty. The write pointer is
``cur``: a forward writes its Q slots at [cur, cur+Q), the update copies the accepted ones to [cur, cur+D+1) and
moves every layer's pointer to the new end, in place.

Rows: a batch keeps its shape while its rows decode; once rows have stopped, ``compact`` moves the live rows to the
front and the cycle goes on over views of the first rows (same addresses, so no new memory, and a captured graph per
batch size). ``plan`` picks the rows: CUDA-graph runs shrink to powers of two (a batch of 16 runs at 8, 4, 2, 1
rows), bounding the captures; eager runs to the live rows exactly; compiled runs keep their batch (each new size
would be a new compile). Eagerly (``eager``), each forward also runs over a view of the slots in use only, where a
captured graph needs the whole length.

Trees: the buffers are sized for a call's capacity (the largest tree it may draft: the chooser may switch trees
between cycles, ``chooser.py``) and a smaller tree runs on views of their first columns (``set_tree``), kept per
shape like the row views.

Everything a step writes in place lives in ``Buffers`` or the target cache (``Target``), kept between calls by the
decoder and marked as static addresses: a captured graph is bound to them. Both are frozen and compared by
identity: a graph keyed on one is bound to the tensors it holds.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..hf.cache import cache_slots, cache_view, filled_layers, grown, grown_cache, layer_rows, static_cache, \
    static_rows
from ..hf.dynamo import mark_static
from .draft import HeadCache, scratch_slots

__all__ = ["Storage", "Target", "Buffers", "plan", "prefill_length", "cache_length", "first_length"]

_SLOT_ROUND = 128  # cache lengths are rounded up so that repeated calls reuse one cache and one graph
_PREFILL_MIN = 16  # the shortest prefill bucket; buckets double from there
_EAGER_ROUND = 32  # eager forwards attend to the slots in use, rounded up to this
_FIRST_ROOM = 64  # slots for committed tokens a growing cache starts with past the prompt; it doubles from there


def prefill_length(prompt_len: int) -> int:
    """The bucket a text prompt is prefilled in: the next power of two >= prompt_len (at least 16), so that prompts
    of nearby lengths replay one prefill graph. The prompt is left-padded into it with empty slots."""
    n = _PREFILL_MIN
    while n < prompt_len:
        n *= 2
    return n


def _rounded(slots: int) -> int:
    return -(-slots // _SLOT_ROUND) * _SLOT_ROUND


def cache_length(prompt_len: int, max_length: int, batch: int, q_len: int, depth: int) -> int:
    """The most target cache slots a call can use: the (bucketed) prompt, every committed token, one tree, rounded.

    One row commits at least one token per cycle and the pointer advances by the longest accepted path, so with
    B = 1 the committed slots are exactly the new tokens; with B > 1 rows that accept less leave holes, up to D+1
    slots per cycle."""
    new = max_length - prompt_len
    committed_slots = new if batch == 1 else new * (depth + 1)
    return _rounded(prompt_len + committed_slots + q_len + depth + 1)


def first_length(prompt_len: int, limit: int, q_len: int, depth: int) -> int:
    """The slots a growing cache starts with: the (bucketed) prompt, a first block of committed tokens and one tree,
    rounded, and never more than the call's most (``limit``, ``cache_length``)."""
    return min(_rounded(prompt_len + _FIRST_ROOM + q_len + depth + 1), limit)


def plan(slots: list[int], finished: list[bool], powers_of_two: bool) -> list[int] | None:
    """Storage rows to keep, in their new order (live rows first), or None to keep the batch as it is.

    slots[i]: the call's row held in storage row i; finished: per call row."""
    live = [i for i, b in enumerate(slots) if not finished[b]]
    if not live:
        return None
    size = 1 << (len(live) - 1).bit_length() if powers_of_two else len(live)
    if size >= len(slots):
        return None
    dead = [i for i, b in enumerate(slots) if finished[b]]
    return live + dead[: size - len(live)]  # a power-of-two batch keeps some finished rows as padding


@dataclass(frozen=True, eq=False)
class Target:
    """The target side of a forward: its cache and slot positions, and how the model takes them."""

    cache: object  # the HF Cache of static layers (a view over the live rows, or eagerly over the slots in use)
    pos: torch.Tensor  # (B, L) position of each slot, -1 empty
    kinds: tuple  # masks.LayerKind of each decoder layer
    kwarg: str  # the forward keyword that takes the cache


# the Buffers with one column per tree node
_NODE_COLUMNS = ("tokens", "parent", "depth", "q_pos", "rank", "q_nodes", "u")


@dataclass(frozen=True, eq=False)
class Buffers:
    """The engine's state between cycles, at fixed addresses (all marked static)."""

    head: HeadCache  # the head's cache (B, nkv, C + S, hd): C committed slots, then S draft scratch slots
    cur: torch.Tensor  # () committed slots so far, in the target's cache and the head's alike
    root: torch.Tensor  # (B,) last committed token, not yet in the target cache
    root_pos: torch.Tensor  # (B,)
    root_out: torch.Tensor  # (B, H) head output at the entry pairing the previous feature with the root
    root_logits: torch.Tensor  # (B, V_draft) fp32
    tokens: torch.Tensor  # (B, Q) the cycle's tree, root first
    parent: torch.Tensor  # (B, Q)
    depth: torch.Tensor  # (B, Q)
    q_pos: torch.Tensor  # (B, Q) positions of the tree nodes
    rank: torch.Tensor  # (B, Q) each node's place among its parent's children, 0 the head's first choice (root: 0)
    q_nodes: torch.Tensor | None  # sampling: (B, Q, V) the draft distribution each node's children came from
    noise: torch.Tensor | None  # sampling: (B, 1 + S, W) the next draft's Exp(1) draws (W: DraftSampler.width)
    u: torch.Tensor | None  # sampling: (B, Q) the acceptance walk's uniforms (``sampling.walk_noise``)
    e: torch.Tensor | None  # sampling: (B, V) the bonus token's Exp(1) draws

    @classmethod
    def like(cls, k: torch.Tensor, v: torch.Tensor, root_out: torch.Tensor, root_logits: torch.Tensor,
             capacity: int, scratch: int, q_len: int, vocab: int | None, width: int | None) -> "Buffers":
        """Zeroed buffers for head keys/values like k, v (B, nkv, S, hd)."""
        B, nkv, _, hd = k.shape
        n, idx = capacity + scratch, dict(dtype=torch.long, device=k.device)
        fp32 = dict(dtype=torch.float32, device=k.device)
        head = HeadCache(k.new_zeros(B, nkv, n, hd), v.new_zeros(B, nkv, n, v.shape[-1]),
                         torch.zeros(B, capacity, **idx), scratch)
        buf = cls(head, torch.zeros((), **idx), torch.zeros(B, **idx), torch.zeros(B, **idx),
                  root_out.new_zeros(B, root_out.shape[-1]), root_logits.new_zeros(B, root_logits.shape[-1]),
                  *(torch.zeros(B, q_len, **idx) for _ in range(5)),
                  torch.zeros(B, q_len, vocab, **fp32) if vocab else None,
                  torch.ones(B, 1 + scratch, width, **fp32) if vocab else None,
                  torch.zeros(B, q_len, **fp32) if vocab else None, torch.ones(B, vocab, **fp32) if vocab else None)
        for t in buf.batched() + [buf.cur]:
            mark_static(t)
        return buf

    def grown(self, capacity: int) -> "Buffers":
        """The same buffers with ``capacity`` committed slots in the head's cache (then the scratch slots, whose
        contents no step reads across cycles), the others shared."""
        h = self.head
        C = h.pos.shape[1]
        k, v = (grown(t, 2, C, capacity + h.scratch) for t in (h.k, h.v))
        head = HeadCache(k, v, grown(h.pos, 1, C, capacity, -1), h.scratch)
        return Buffers(head, **{f.name: getattr(self, f.name) for f in fields(self)[1:]})

    def batched(self) -> list[torch.Tensor]:
        """The buffers with a batch dimension (all but ``cur``)."""
        tensors = [self.head.k, self.head.v, self.head.pos] + [getattr(self, f.name) for f in fields(self)[1:]]
        return [t for t in tensors if t is not None and t.dim() > 0]

    def for_tree(self, q_len: int, scratch: int) -> "Buffers":
        """The same buffers for a smaller tree than they were sized for: its ``q_len`` nodes' columns and the noise of
        its ``scratch`` draft slots (static views at the same addresses; the head's scratch slots past the tree's are
        left unused)."""
        def view(name: str, t):
            if t is not None and name in _NODE_COLUMNS:
                return mark_static(t[:, :q_len])
            return mark_static(t[:, :1 + scratch]) if t is not None and name == "noise" else t
        return Buffers(**{f.name: view(f.name, getattr(self, f.name)) for f in fields(self)})

    def rows(self, n: int) -> "Buffers":
        """The same buffers over their first n rows (static views at the same addresses)."""
        h = self.head
        head = HeadCache(static_rows(h.k, n), static_rows(h.v, n), static_rows(h.pos, n), h.scratch)
        return Buffers(head, **{f.name: static_rows(t, n) if t is not None and t.dim() > 0 else t
                                for f in fields(self)[1:] for t in (getattr(self, f.name),)})


class Storage:
    """One decoder's memory, kept between its calls: the target cache and its slot positions, the head's buffers, and
    their views over the first rows. During a call: the rows and slots in use (``target``, ``buf``, ``cur``).

    The cache grows with the tokens committed: it starts with room for the prompt and a first block
    (``first_length``) and ``reserve`` doubles it before a cycle that would not fit, up to the call's most
    (``cache_length``), so that a call stopping early holds what it used. Each length is a new set of addresses (its
    graphs are captured once). Memory is kept for later calls that fit it (``prepare``, ``start``); a call that can use
    fewer slots than the kept cache holds allocates its own. Compiled runs allocate their most up front and go on with
    a longer kept cache: every new length would be a new compile. ``release`` frees it all."""

    def __init__(self):
        self.cache = None  # the HF Cache at full batch
        self.pos: torch.Tensor | None = None  # (B, L) slot positions
        self.full: Buffers | None = None  # the head's buffers at full batch
        self._batch = self.kinds = self.kwarg = self._key = None
        self._whole: Target | None = None  # the whole cache: one object, kept while its memory lives (graph keys)
        self._views: dict[int, tuple[Target, Buffers]] = {}  # n -> the first n rows, kept likewise
        self._tree_views: dict[tuple, Buffers] = {}  # (rows, nodes, scratch) -> the buffers of a smaller tree
        self.tree = None  # the TreeConfig the cycle drafts (``set_tree``): ``buf`` holds its columns
        self._slot_views: dict[int, Target] = {}  # eager: n -> the first n slots (this call)
        self.target: Target | None = None  # the rows in use
        self.buf: Buffers | None = None
        self.batch = self.cur = self.length = 0
        self.eager = self._filled = self.grows = False
        self.limit = 0  # the call's most slots
        self._host = self._read_done = None  # the host read's pinned landing buffer and its event (CUDA)
        self.generation = 0  # counts allocations: graphs bound to the memory of an earlier generation are stale

    def prepare(self, num_layers: int, batch: int, limit: int, first: int, kinds: tuple, kwarg: str, *, eager: bool,
                grows: bool) -> None:
        """Ready a cache for ``batch`` rows and a call that uses ``first`` slots to begin with and ``limit`` at most:
        the kept one when it holds ``first`` to ``limit`` slots (any more, if the cache does not grow), so that calls of
        one shape replay the same graphs, else a new one of ``first`` slots."""
        kept = cache_slots(self.cache) if self.cache is not None else 0
        new = (self.cache is None or len(self.cache.layers) != num_layers or self._batch != batch or kept < first
               or (grows and kept > limit) or self.kinds != kinds or self.kwarg != kwarg)
        if new:
            self.release()
            self.cache, self._batch, self.kinds, self.kwarg = static_cache(num_layers, first), batch, kinds, kwarg
            self._filled, self.generation = False, self.generation + 1
        self.cache.reset()  # zeros the stored slots and every layer's write pointer, in place
        self.length, self.batch, self.eager, self._slot_views = cache_slots(self.cache), batch, eager, {}
        self.limit, self.grows = limit, grows

    def positions(self, slot_pos: torch.Tensor) -> Target:
        """The prompt's slot positions (B, T) at [0, T) (the rest empty); returns the full target."""
        B, T = slot_pos.shape
        if self.pos is None or self.pos.device != slot_pos.device or self.pos.shape != (B, self.length):
            self.pos = mark_static(slot_pos.new_empty(B, self.length))  # kept at one address: graphs write it
            self._whole, self.generation = None, self.generation + 1
        if self._whole is None or self._whole.cache is not self.cache:
            self._whole, self._views, self._tree_views = Target(self.cache, self.pos, self.kinds, self.kwarg), {}, {}
        self.pos.fill_(-1)
        self.pos[:, :T] = slot_pos
        self.cur, self.target = T, self._whole
        return self.target

    def start(self, k, v, head_pos, root, root_pos, root_out, root_logits, *, scratch: int, q_len: int,
              vocab: int | None, width: int | None) -> None:
        """Copy the prefill's head entries k, v (B, nkv, S, hd), head_pos (B, S) (one per prompt slot) and the root
        into the buffers."""
        S = k.shape[2]
        if S != self.cur:
            raise ValueError(f"head cache of {S} entries does not match the target's {self.cur} prefilled slots")
        key = (self.length, (tuple(k.shape[:2]), k.shape[3], v.shape[3], scratch, q_len, vocab, width,
                             root_out.shape[-1], root_logits.shape[-1], k.dtype, root_out.dtype, root_logits.dtype,
                             k.device))
        if key != self._key:  # one live set: a new shape frees the old one
            self.full, self._key, self._views, self._tree_views = None, None, {}, {}
            self.full = Buffers.like(k, v, root_out, root_logits, self.length, scratch, q_len, vocab, width)
            self._key, self.generation = key, self.generation + 1
        b = self.full
        b.head.k.zero_()
        b.head.v.zero_()
        b.head.k[:, :, :S], b.head.v[:, :, :S] = k, v
        b.head.pos.fill_(-1)
        b.head.pos[:, :S] = head_pos
        b.cur.fill_(S)
        for dst, src in ((b.root, root), (b.root_pos, root_pos), (b.root_out, root_out), (b.root_logits, root_logits)):
            dst.copy_(src)
        self._use_rows(self.batch)

    def set_tree(self, tree) -> None:
        """Draft ``tree`` (a TreeConfig within the capacity the buffers were sized for) from the next cycle on."""
        self.tree = tree
        if self.full is not None:
            self._use_rows(self.batch)

    def compact(self, keep: list[int]) -> None:
        """Go on with the storage rows ``keep`` (``plan``): moved to the first rows of the full-size cache and
        buffers, which the cycle then runs on as views."""
        n = len(keep)
        idx = None
        for t in layer_rows(self.cache) + [self.pos] + self.full.batched():
            if idx is None or idx.device != t.device:
                idx = torch.tensor(keep, device=t.device)
            t[:n].copy_(t[: self.batch].index_select(0, idx))  # index_select copies: sources may overlap
        self._use_rows(n)

    def reserve(self, need: int) -> None:
        """Room for ``need`` slots at ``cur`` (the next cycle's tree): a growing cache doubles first (at most to the
        call's most)."""
        end = self.cur + need
        if end > self.length and self.grows and self.length < self.limit:
            self.grow(min(max(2 * self.length, _rounded(end)), self.limit))

    def grow(self, length: int) -> None:
        """Go on in a cache, slot positions and head buffers of ``length`` slots that hold what the current ones hold
        (kept for later calls in their place; the current ones are freed once nothing holds them)."""
        self.cache = grown_cache(self.cache, length)
        self.pos = grown(self.pos, 1, self.length, length, -1)
        self.full = self.full.grown(length)
        self.length, self._key, self.generation = length, (length, self._key[1]), self.generation + 1
        self._whole, self._views, self._slot_views = Target(self.cache, self.pos, self.kinds, self.kwarg), {}, {}
        self._tree_views = {}
        self._use_rows(self.batch)

    def _use_rows(self, n: int) -> None:
        """Run on the first n rows of the cache and buffers, and on the columns of the tree that runs: views at their
        addresses, kept per shape (graph keys)."""
        if n == self._batch:
            self.target, self.buf = self._whole, self.full
        else:
            if n not in self._views:
                target = Target(cache_view(self.cache, rows=n), static_rows(self.pos, n), self.kinds, self.kwarg)
                self._views[n] = (target, self.full.rows(n))
            self.target, self.buf = self._views[n]
        self.batch, self._slot_views = n, {}
        t = self.tree
        q_len, scratch = t.total_tokens + 1, max(0, scratch_slots(t.top_k, t.depth))
        if q_len < self.buf.tokens.shape[1] or self.buf.noise is not None and 1 + scratch < self.buf.noise.shape[1]:
            if (n, q_len, scratch) not in self._tree_views:
                self._tree_views[(n, q_len, scratch)] = self.buf.for_tree(q_len, scratch)
            self.buf = self._tree_views[(n, q_len, scratch)]

    def in_use(self, end: int) -> Target:
        """The target for a forward whose slots end before ``end``: eagerly, a view over the first slots (rounded up,
        and kept for the call); else the whole cache, as a captured or compiled step needs it."""
        if end > self.length:
            raise RuntimeError(f"static cache of {self.length} slots is full ({self.cur} used, a tree needs "
                               f"{end - self.cur})")
        if not self.eager:
            return self.target
        if not self._filled:  # views need the layers a first forward allocates
            self._filled = bool(filled_layers(self.cache))
            if not self._filled:
                return self.target
        n = min(-(-end // _EAGER_ROUND) * _EAGER_ROUND, self.length)
        if n not in self._slot_views:
            self._slot_views[n] = Target(cache_view(self.target.cache, slots=n), self.target.pos[:, :n],
                                         self.kinds, self.kwarg)
        return self._slot_views[n]

    def read(self, packed: torch.Tensor) -> torch.Tensor:
        """Start the cycle's one host read of ``packed``; returns the host tensor it lands in, to be read after
        ``wait()``. On CUDA the copy is queued behind the device's work, and what the host launches before ``wait``
        runs after it."""
        if not packed.is_cuda:
            return packed.cpu()
        if self._host is None or self._host.shape != packed.shape:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._read_done = torch.cuda.Event()
        self._host.copy_(packed, non_blocking=True)
        self._read_done.record()
        return self._host

    def wait(self) -> None:
        """Wait for the copy ``read`` started on CUDA (only the copy, not the work queued after it)."""
        self._read_done.synchronize()

    def release(self) -> None:
        """Free the cache and buffers (the next call allocates them again)."""
        self.cache = self.pos = self.full = self.target = self.buf = self._whole = None
        self._host = self._read_done = None
        self._batch = self.kinds = self.kwarg = self._key = None
        self._views, self._slot_views, self._tree_views = {}, {}, {}
