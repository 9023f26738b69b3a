"""The engine's storage: fixed-address buffers and fixed shapes, so each step of the cycle can run as a CUDA graph.

Every cycle runs the same shapes: the tree always has ``total_tokens + 1`` nodes (``select_tree`` keeps exactly
that many), the target's KV cache is an HF ``Cache`` of ``StaticLayer`` of a fixed length L, the verify mask is
(B, 1, Q, L), the kept path is always written as D+1 slots (those past the accepted length are padding that the
next cycle overwrites), and the head's cache is a fixed buffer with scratch slots for the draft steps. The
cycle's steps are then functions of tensors (``steps.py``): ``prefill_step`` (text prompts, bucketed by length),
``draft_step``, ``verify_step``, ``accept_step`` (sampling with input-free warpers; its noise drawn outside it) and
``update_step``. ``graphs.wrapped`` runs each one eagerly, captured as a CUDA graph, or compiled and captured.

Slots: ``pos`` (B, L) holds the token position in each target cache slot, -1 where empty. The write pointer is
``cur``: a forward writes its Q slots at [cur, cur+Q) (HF's ``StaticLayer`` writes at its ``cumulative_length``,
which it then advances by Q), the update copies the accepted ones to [cur, cur+D+1) and sets every layer's
``cumulative_length`` to the new pointer, in place (transformers 5.17's ``StaticLayer`` has no ``crop``).
Sliding-window and chunked layers are stored in full; the mask applies their rule. The head's slots follow the
target's one for one.

Everything a step writes in place lives in ``Buffers`` or the target cache, kept between calls per (head, shape)
and per model and marked as static addresses: a captured graph is bound to them. No output of a graph is read
after that graph runs again.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields

import torch

from ..target.compat import cache_kwarg
from .accept import accept
from .draft import HeadCache, scratch_slots
from .graphs import CUDA_GRAPH_MODES, OwnGraph, nothing_to_undo, setup_seconds, wrapped
from .masks import LayerKind
from .rows import cache_view, move_rows, static_rows
from .processors import reads_input_ids
from .sampling import draft_noise, walk_noise
from .steps import accept_step, advance_step, draft_step, prefill_step, update_step, verify_step
from .tree import Tree

__all__ = ["FixedStorage", "Buffers", "cache_length", "prefill_length"]

_SLOT_ROUND = 128  # cache lengths are rounded up so that repeated calls reuse one cache and one graph
# What compile=True compiles: the target's verify forward, where fusing its many small kernels pays most, and the
# update. The draft's unrolled levels are the slowest to compile: only the "max-autotune" modes, which ask for
# speed at any compile time, compile it too. Measured on the H200 (bf16): code-tiny's cold first call 15.5 s with
# the verify alone, 23-27 s with the update, 70 s with the draft too; the 8B-shaped cycle 9.4, 8.7 and 7.45 ms.
# The prefill runs once per call, and compiling it would cost every new prompt bucket a compile: never compiled.
_COMPILED_STEPS = ("verify", "update")
_MAX_COMPILED_STEPS = ("verify", "update", "draft")
_PREFILL_MIN = 16  # the shortest prefill bucket; buckets double from there


def prefill_length(prompt_len: int) -> int:
    """The bucket a text prompt is prefilled in: the next power of two >= prompt_len (at least 16), so that prompts
    of nearby lengths replay one prefill graph. The prompt is left-padded into it with empty slots."""
    n = _PREFILL_MIN
    while n < prompt_len:
        n *= 2
    return n


def cache_length(prompt_len: int, max_length: int, batch: int, q_len: int, depth: int) -> int:
    """Target cache slots: the (bucketed) prompt, every committed token, one tree, rounded up.

    One row commits at least one token per cycle and the pointer advances by the longest accepted path, so with
    B = 1 the committed slots are exactly the new tokens; with B > 1 rows that accept less leave holes, up to D+1
    slots per cycle."""
    new = max_length - prompt_len
    committed_slots = new if batch == 1 else new * (depth + 1)
    need = prompt_len + committed_slots + q_len + depth + 1
    return -(-need // _SLOT_ROUND) * _SLOT_ROUND


@dataclass
class _TargetCache:
    batch: int
    cache: object  # the HF Cache of StaticLayers
    pos: torch.Tensor | None = None  # (B, L) slot positions, allocated at the first prefill
    views: dict = field(default_factory=dict)  # n -> the cache over its first n rows (rows.cache_view), kept: graphs


# One target cache per model and one set of buffers per head, kept between calls: graphs are bound to them.
_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BUFFERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _target_cache(model, batch: int, length: int, n: int) -> _TargetCache:
    """An n-layer static cache of at least ``length`` slots: the model's previous one when it is long enough
    (as ``generate`` reuses its static cache), so that calls with shorter prompts replay the same graphs."""
    from transformers.cache_utils import Cache, StaticLayer

    entry = _CACHES.get(model)
    if (entry is None or len(entry.cache.layers) != n or entry.batch != batch
            or entry.cache.layers[0].max_cache_len < length):
        entry = _TargetCache(batch, Cache(layers=[StaticLayer(max_cache_len=length) for _ in range(n)]))
        _CACHES[model] = entry  # one live cache per model: a new shape frees the old one
    entry.cache.reset()  # zeros the stored slots and every layer's cumulative_length, in place
    return entry


@dataclass
class Buffers:
    """The engine's state between cycles, at fixed addresses (all marked static)."""

    head_k: torch.Tensor  # (B, nkv, C + S, hd) the head's cache: C committed slots, then S draft scratch slots
    head_v: torch.Tensor  # (B, nkv, C + S, hd_v)
    head_pos: torch.Tensor  # (B, C) position of each committed head slot, -1 empty
    cur: torch.Tensor  # () committed slots so far, in the target's cache and the head's alike
    root: torch.Tensor  # (B,) last committed token, not yet in the target cache
    root_pos: torch.Tensor  # (B,)
    root_out: torch.Tensor  # (B, H) head output at the entry pairing the previous feature with the root
    root_logits: torch.Tensor  # (B, V_draft) fp32
    tokens: torch.Tensor  # (B, Q) the cycle's tree, root first
    parent: torch.Tensor  # (B, Q)
    depth: torch.Tensor  # (B, Q)
    q_pos: torch.Tensor  # (B, Q) positions of the tree nodes
    q_nodes: torch.Tensor | None  # sampling: (B, Q, V) the draft distribution each node's children came from
    noise: torch.Tensor | None  # sampling: (B, 1 + S, W) the next draft's Exp(1) draws (W: DraftSampler.width)
    u: torch.Tensor | None  # sampling: (B, Q) the acceptance walk's uniforms (``sampling.walk_noise``)
    e: torch.Tensor | None  # sampling: (B, V) the bonus token's Exp(1) draws

    @classmethod
    def like(cls, hcache: HeadCache, root_out: torch.Tensor, root_logits: torch.Tensor, capacity: int,
             scratch: int, q_len: int, vocab: int | None, width: int | None) -> "Buffers":
        B, nkv, _, hd = hcache.k.shape
        n, idx = capacity + scratch, dict(dtype=torch.long, device=hcache.k.device)
        fp32 = dict(dtype=torch.float32, device=hcache.k.device)
        buf = cls(hcache.k.new_zeros(B, nkv, n, hd), hcache.v.new_zeros(B, nkv, n, hcache.v.shape[-1]),
                  torch.zeros(B, capacity, **idx), torch.zeros((), **idx), torch.zeros(B, **idx),
                  torch.zeros(B, **idx), root_out.new_zeros(B, root_out.shape[-1]),
                  root_logits.new_zeros(B, root_logits.shape[-1]), *(torch.zeros(B, q_len, **idx) for _ in range(4)),
                  torch.zeros(B, q_len, vocab, **fp32) if vocab else None,
                  torch.ones(B, 1 + scratch, width, **fp32) if vocab else None,
                  torch.zeros(B, q_len, **fp32) if vocab else None, torch.ones(B, vocab, **fp32) if vocab else None)
        for f in fields(buf):
            if getattr(buf, f.name) is not None:
                torch._dynamo.mark_static_address(getattr(buf, f.name))
        return buf

    def batched(self) -> list[torch.Tensor]:
        """The buffers with a batch dimension (all but ``cur``)."""
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None and t.dim() > 0]

    def rows(self, n: int) -> "Buffers":
        """The same buffers over their first n rows (static views at the same addresses)."""
        return Buffers(**{f.name: static_rows(t, n) if t is not None and t.dim() > 0 else t
                          for f in fields(self) for t in (getattr(self, f.name),)})

    def for_tree(self, q_len: int, scratch: int) -> "Buffers":
        """The buffers a smaller tree's steps use (the chooser's trees within the capacity they were sized for): the
        first ``q_len`` nodes of the tree's buffers and the noise of ``scratch`` draft slots (static column views at
        the same addresses; the head's scratch slots past the tree's are left unused)."""
        cols = {"tokens", "parent", "depth", "q_pos", "q_nodes", "u"}
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None and (f.name in cols or f.name == "noise"):
                t = t[:, : q_len if f.name in cols else 1 + scratch]
                torch._dynamo.mark_static_address(t)
            out[f.name] = t
        return Buffers(**out)


class FixedStorage:
    """One call's engine: the target's static cache, the head's buffers, and the cycle's step functions
    (run as ``mode`` says: None eager, "graphs", or a ``torch.compile`` mode; see ``graphs.wrapped``).

    The host keeps its own copy of the write pointer (``cur``) for the room checks; ``advance`` moves it on after
    the cycle's host read, as ``update_step`` moved the device's. ``compact`` goes on with fewer rows (``rows.py``):
    eager and CUDA-graph runs do (graphs in powers of two), compiled runs keep their batch.
    """

    def __init__(self, model, head, kinds: list[LayerKind], tree, batch: int, prompt_len: int, max_length: int,
                 mode: str | None, sampler=None, capacity=None):
        # The draft step is keyed on the sampler: one object per warper setting; the call's generator stays here.
        self.generator = sampler.generator if sampler is not None else None
        sampler = sampler.for_graphs() if sampler is not None else None
        self.model, self.head, self.kinds, self.tree, self.mode, self.sampler = model, head, kinds, tree, mode, sampler
        # The buffers are sized for ``capacity`` (the largest tree the call may switch to, ``set_tree``), the tree runs.
        self.capacity = capacity or tree
        self._cache_kwarg = cache_kwarg(model)
        new = max_length - prompt_len  # the prompt takes its bucket's slots (text) or its own (images): the larger
        length = cache_length(prefill_length(prompt_len), prefill_length(prompt_len) + new, batch,
                              self.capacity.total_tokens + 1, self.capacity.depth)
        self._entry = _target_cache(model, batch, length, len(kinds))
        self.cache = self._entry.cache
        self.length = self.cache.layers[0].max_cache_len
        self.cur = 0
        self.buf: Buffers | None = None
        self._full: Buffers | None = None
        self.batch = batch  # rows the cycle runs on: fewer after ``compact``
        self.compacts, self.pow2 = mode in (None, "graphs"), mode == "graphs"
        self._next = None  # the next cycle's draft, launched ahead of the host read
        self._host = self._read_done = None  # pinned landing buffer and its event, on CUDA
        self._prefill = wrapped(model, "prefill", prefill_step, _step_mode("prefill", mode), unkeyed=(4,))
        # Bucketing pads a prompt so that nearby lengths replay one captured prefill: eagerly, padding only costs.
        self._bucketed = _step_mode("prefill", mode) == "graphs"
        # Eager forwards (no graph, no compile: shapes may change) attend to the slots in use only (``_in_use``).
        self._eager, self._views = mode is None, {}
        self._verify = wrapped(model, "verify", verify_step, _step_mode("verify", mode), unkeyed=(4,))
        self._draft = wrapped(head, "draft", draft_step, _step_mode("draft", mode))
        self._update = wrapped(head, "update", update_step, _step_mode("update", mode))
        self._accept = wrapped(head, "accept", accept_step, _step_mode("accept", mode))
        self._advance = wrapped(model, "advance", advance_step, _step_mode("advance", mode))
        self._tree_views: dict = {}  # (rows, q_len, scratch) -> Buffers views for the tree that runs

    @property
    def setup(self) -> float:
        """Seconds this engine's step functions have spent compiling or capturing, over all calls so far."""
        return setup_seconds(self._prefill, self._verify, self._draft, self._update, self._accept, self._advance)

    def _slot_positions(self, slot_pos: torch.Tensor) -> torch.Tensor:
        B, T = slot_pos.shape
        pos = self._entry.pos
        if pos is None or pos.device != slot_pos.device or pos.shape != (B, self.length):
            # Kept between calls at one address: the update graph writes it in place.
            pos = self._entry.pos = slot_pos.new_empty(B, self.length)
            torch._dynamo.mark_static_address(pos)
        pos.fill_(-1)
        self.cur, self._pos = T, pos
        return pos

    def prefill(self, cap, input_ids, slot_pos, position_ids, extra: dict | None):
        """The prompt's forward into slots [0, T'). Returns (logits (B, V) after the last token, features (B, T', F),
        input ids (B, T'), slot positions (B, T')); T' = ``prefill_length(T)`` for text prompts whose prefill is
        captured (left-padded with empty slots), else T (eager; a vision-language prompt, ``extra``: its image
        inputs, run by the model's own forward)."""
        if extra is not None:  # images: the model's own forward (vision tower, merged embeddings, its image masks)
            mask = (slot_pos >= 0).long()
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, **extra,
                             **{self._cache_kwarg: self.cache}, use_cache=True, logits_to_keep=1)
            pos = self._slot_positions(slot_pos)
            pos[:, : slot_pos.shape[1]] = slot_pos
            return out.logits[:, -1], cap.features(), input_ids, slot_pos
        B, T = input_ids.shape
        pad = prefill_length(T) - T if self._bucketed else 0
        if pad:
            input_ids = torch.cat((input_ids.new_zeros(B, pad), input_ids), 1)
            slot_pos = torch.cat((slot_pos.new_full((B, pad), -1), slot_pos), 1)
            position_ids = torch.cat((position_ids.new_zeros(B, pad), position_ids), 1)
        pos = self._slot_positions(slot_pos)
        write = torch.arange(T + pad, device=input_ids.device)
        cache, used = self._in_use(T + pad)
        args = (self.model, cache, self.kinds, self._cache_kwarg, cap, input_ids, slot_pos, used, write,
                position_ids)
        # Also initializes a new cache's layers, before any compiled step. It writes slots [0, T') and moves the
        # write pointers from 0, which a second run (the capture's) repeats once they are put back.
        logits, feats = _run(self._prefill, self._undo_pointers(0), *args)
        pos[:, : T + pad] = slot_pos
        return logits[:, -1], feats, input_ids, slot_pos

    def _in_use(self, n: int):
        """(cache, slot positions) for a forward whose slots end before n: eagerly, views over the first n slots
        (rounded up to 32, and kept per length for the call); else the whole cache and positions."""
        if not self._eager or self.cache.layers[0].is_initialized is False:
            return self.cache, self._pos
        n = min(-(-n // 32) * 32, self.length)
        if self._views.get(n, (None,))[0] is not self.cache:  # a view of this batch's cache (rows change it)
            self._views[n] = (self.cache, cache_view(self.cache, slots=n))
        return self._views[n][1], self._pos[:, :n]

    def _layers_initialized(self) -> list:
        return [la for la in self.cache.layers if la.is_initialized]

    def start(self, hcache: HeadCache, root, root_pos, root_out, root_logits) -> None:
        """Copy the prefill's head cache (S entries, one per prompt slot) and the root into the buffers."""
        t, S = self.capacity, hcache.k.shape[2]
        if S != self.cur:
            raise ValueError(f"head cache of {S} entries does not match the target's {self.cur} prefilled slots")
        scratch, q_len = max(0, scratch_slots(t.top_k, t.depth)), t.total_tokens + 1
        vocab = self.sampler.vocab_size if self.sampler is not None else None
        width = self.sampler.width if self.sampler is not None else None
        key = (tuple(hcache.k.shape[:2]), hcache.k.shape[3], hcache.v.shape[3], self.length, scratch, q_len, vocab,
               width, root_out.shape[-1], root_logits.shape[-1], hcache.k.dtype, root_out.dtype, root_logits.dtype,
               hcache.k.device)
        old_key, buf = _BUFFERS.get(self.head, (None, None))
        if old_key != key:
            buf = Buffers.like(hcache, root_out, root_logits, self.length, scratch, q_len, vocab, width)
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
        self._full, self._next, self._tree_views = buf, None, {}
        self.buf = self._tree_buffers()
        self._layers = self._layers_initialized()

    def _tree_buffers(self) -> Buffers:
        """The buffers of the rows that run (``compact``) for the tree that runs (``set_tree``), kept per shape:
        views marked static are the same objects cycle after cycle."""
        t = self.tree
        key = (self.batch, t.total_tokens + 1, max(0, scratch_slots(t.top_k, t.depth)))
        if key not in self._tree_views:
            rows = self._full if self.batch == self._full.root.shape[0] else self._full.rows(self.batch)
            self._tree_views[key] = rows if t == self.capacity else rows.for_tree(key[1], key[2])
        return self._tree_views[key]

    def set_tree(self, tree) -> None:
        """Draft ``tree`` from the next cycle on (a tree within the capacity the buffers were sized for). A draft
        launched ahead for the previous tree is dropped."""
        if tree == self.tree:
            return
        if not tree.fits(self.capacity):
            raise ValueError(f"{tree} does not fit the buffers sized for {self.capacity}")
        self.tree, self._next = tree, None
        if self._full is not None:
            self.buf = self._tree_buffers()

    def compact(self, keep: list[int]) -> None:
        """Go on with the storage rows ``keep`` (``rows.plan``): moved to the first rows of the full-size cache and
        buffers, which the cycle then runs on as views. A draft launched ahead moves with its rows."""
        n, entry = len(keep), self._entry
        layers = [la for la in entry.cache.layers if la.is_initialized]
        full = [la.keys for la in layers] + [la.values for la in layers] + [entry.pos] + self._full.batched()
        move_rows([t[: self.batch] for t in full], keep, self.batch)
        if n not in entry.views:
            entry.views[n] = cache_view(entry.cache, rows=n)
        self.batch, self.cache, self._pos = n, entry.views[n], static_rows(entry.pos, n)
        self.buf = self._tree_buffers()
        self._layers = [la for la in self.cache.layers if la.is_initialized]
        if self._next is not None:
            b = self.buf
            self._next = (Tree(b.tokens, b.parent, b.depth), b.q_pos, b.q_nodes)

    def draft(self):
        """This cycle's tree: the one ``read`` launched ahead, or drafted now. Returns (Tree (B, Q), q_pos (B, Q),
        q_nodes (B, Q, V) or None), all in the buffers."""
        ahead, self._next = self._next, None
        return ahead if ahead is not None else self._launch_draft()

    def _launch_draft(self):
        b, t, s = self.buf, self.tree, self.sampler
        if not t.drafts:  # the root alone (its parent and depth columns hold 0 from the start)
            b.tokens[:, 0].copy_(b.root)
            b.q_pos[:, 0].copy_(b.root_pos)
            return Tree(b.tokens, b.parent, b.depth), b.q_pos, b.q_nodes
        if s is not None:
            draft_noise(b.noise, self.generator)  # outside the graph: a user's torch.Generator cannot be captured
        _run(self._draft, nothing_to_undo, self.head, b.head_k, b.head_v, b.head_pos, b.root, b.root_pos, b.root_out,
             b.root_logits, b.tokens, b.parent, b.depth, b.q_pos, b.q_nodes, b.noise, s, t.top_k, t.depth,
             t.total_tokens)
        return Tree(b.tokens, b.parent, b.depth), b.q_pos, b.q_nodes

    def verify(self, cap, tree: Tree, q_pos: torch.Tensor, positions: torch.Tensor):
        """Target logits (B, Q, V) and features (B, Q, F) at the Q tree nodes, written to slots [cur, cur+Q)."""
        Q = tree.size
        if self.cur + Q > self.length:
            raise RuntimeError(f"static cache of {self.length} slots is full ({self.cur} used, a tree needs {Q})")
        write = torch.arange(self.cur, self.cur + Q, device=tree.tokens.device)
        cache, used = self._in_use(self.cur + Q)
        return _run(self._verify, self._undo_pointers(self.cur), self.model, cache, self.kinds, self._cache_kwarg,
                    cap, tree.tokens, q_pos, tree.parent, used, write, positions, self.tree.depth)

    def accept(self, tree: Tree, logits, q_nodes, processors, rows: list, depth: int, generator):
        """``accept.accept``; sampling with input-free warpers only, as ``accept_step`` (its noise drawn first, outside
        the step, from the call's generator), which the engine captures like its other steps."""
        if q_nodes is None or reads_input_ids(processors):
            return accept(tree, logits, q_nodes, processors, rows, depth, generator)
        b = self.buf
        walk_noise(b.u, b.e, generator)
        return _run(self._accept, nothing_to_undo, tree.tokens, tree.parent, tree.depth, logits, q_nodes, b.u, b.e,
                    self.sampler, depth)

    def update(self, tokens, q_pos, feats, accept_len, path, bonus) -> torch.Tensor:
        """Keep the accepted paths, extend the head, set the next root (``update_step``); returns the device tensor
        (B, 1 + D+1) of accept lengths and new tokens for the cycle's host read."""
        if self.cur + path.shape[1] > self.length:
            raise RuntimeError(f"static cache of {self.length} slots is full ({self.cur} used, a path needs "
                               f"{path.shape[1]})")
        b, layers = self.buf, self._layers
        if not self.tree.drafts:
            return _run(self._advance, self._undo_advance, [la.cumulative_length for la in layers], self._pos, b.cur,
                        b.root, b.root_pos, bonus)
        return _run(self._update, self._undo_update, self.head, [la.keys for la in layers],
                    [la.values for la in layers], [la.cumulative_length for la in layers], self._pos, b.head_k,
                    b.head_v, b.head_pos, b.cur, b.root, b.root_pos, b.root_out, b.root_logits, tokens, q_pos, feats,
                    accept_len, path, bonus)

    def _undo_pointers(self, at: int):
        """``OwnGraph``'s undo for a forward (the prefill, the verify): it writes the slots at the write pointers,
        which a second run writes again, and moves the pointers on from ``at``, where the restore puts them back."""
        return lambda: lambda: [la.cumulative_length.fill_(at) for la in self._layers_initialized()]

    def _undo_update(self):
        """``OwnGraph``'s undo for ``update_step``: a snapshot of what it reads and writes in place (the verified
        slots, the K kept ones of the positions and the head's cache, the root, the pointers)."""
        b, c, q, k = self.buf, self.cur, self.tree.total_tokens + 1, self.tree.depth + 1
        slices = [(t, (slice(None), slice(None), slice(c, c + q))) for la in self._layers for t in (la.keys, la.values)]
        slices += [(t, (slice(None), slice(c, c + k))) for t in (self._pos, b.head_pos)]
        slices += [(t, (slice(None), slice(None), slice(c, c + k))) for t in (b.head_k, b.head_v)]
        slices += [(t, ...) for t in (b.cur, b.root, b.root_pos, b.root_out, b.root_logits,
                                      *(la.cumulative_length for la in self._layers))]
        saved = [(t, i, t[i].clone()) for t, i in slices]

        def restore():
            for t, i, v in saved:
                t[i] = v
        return restore

    def _undo_advance(self):
        """``OwnGraph``'s undo for ``advance_step``: the slot position it writes, the root and the pointers."""
        b, c = self.buf, self.cur
        saved = [(t, t.clone()) for t in (b.cur, b.root, b.root_pos, *(la.cumulative_length for la in self._layers))]
        pos = self._pos[:, c].clone()

        def restore():
            for t, v in saved:
                t.copy_(v)
            self._pos[:, c] = pos
        return restore

    def read(self, packed: torch.Tensor) -> torch.Tensor:
        """The cycle's one host read of ``update``'s output. On CUDA the next cycle's draft is queued behind the
        copy, so the GPU drafts while the host commits: it reads only what ``update`` just wrote, so it is the next
        cycle's draft whatever the host decides (unused when decoding stops there)."""
        if not packed.is_cuda:
            return packed.cpu()
        if self._host is None or self._host.shape != packed.shape:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._read_done = torch.cuda.Event()
        self._host.copy_(packed, non_blocking=True)
        self._read_done.record()
        self._next = self._launch_draft()
        self._read_done.synchronize()  # waits for the copy only, not for the draft queued after it
        return self._host

    def advance(self, n: int) -> None:
        self.cur += n


def _run(fn, undo, *args):
    """A step as ``wrapped`` built it; a CUDA-graph step captures a new signature in this call (``OwnGraph``'s undo),
    so that every shape a call runs (a batch that shrinks mid-call too) is replayed by the next call."""
    return fn(*args, undo=undo) if isinstance(fn, OwnGraph) else fn(*args)


def _step_mode(step: str, mode: str | None) -> str | None:
    """How ``step`` runs under the call's ``mode``: compile modes compile only ``_COMPILED_STEPS`` (the
    "max-autotune" modes ``_MAX_COMPILED_STEPS``); the other steps are captured as they are when the mode captures
    CUDA graphs (it does on CUDA), else run eagerly."""
    compiled = _MAX_COMPILED_STEPS if mode is not None and mode.startswith("max-autotune") else _COMPILED_STEPS
    if mode in (None, "graphs") or step in compiled:
        return mode
    return "graphs" if mode in CUDA_GRAPH_MODES else None
