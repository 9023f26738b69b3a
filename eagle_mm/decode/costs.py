"""What a decode cycle costs on this machine, by tree shape and batch: measured once, then read from a table.

A cycle of the engine (``fixed.py``) with a tree of depth d, top_k k and N nodes runs
  verify(N + 1)  the target's forward over the root and the N nodes of every row, and the acceptance;
  draft(k, d)    the head's first level (from the root's logits) and d - 1 further levels over k nodes each;
  update(d + 1)  keeping the accepted path in both caches and running the head over it;
and a cycle without a tree (``TreeConfig.none()``) verify(1) and ``advance``. ``probe`` times each of these steps
as the engine runs them: the same step functions (``steps.py``), captured as CUDA graphs and replayed on CUDA, eager
(with ``skinny.py``'s linears) on a CPU, for a handful of sizes, and ``CycleCosts`` interpolates between them.
What the host does around the steps per cycle (committing tokens, stopping checks, the host read) is not probed:
the chooser learns it from the cycles it watches (``chooser.Chooser.overhead``).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from ..config import TreeConfig
from ..target.compat import cache_kwarg
from .accept import accept
from .draft import extend_head, scratch_slots
from .sampling import draft_noise, walk_noise
from .skinny import skinny_linears
from .steps import advance_step, draft_step, prefill_step, update_step, verify_step
from .tree import Tree

logger = logging.getLogger(__name__)

__all__ = ["CycleCosts", "cycle_seconds", "probe", "PREFIX"]

PREFIX = 128  # cached tokens the probed forwards attend to
_QS = (1, 2, 4, 8, 16, 32, 64)  # tokens per row at which the verify is timed (1: no tree)
_KS = (1, 8)  # top_k at which a draft level is timed (linear between: a level runs the head on top_k nodes)
_KEPT = (2, 9)  # slots the update keeps (depth + 1) at which it is timed
_STEEP = 3.0  # past this many times the 1-token verify, bigger trees cannot pay: the verify stops growing
_MAX_TOKENS = {"cuda": 4096, "cpu": 512}  # batch x tokens per row timed at most; past it, extrapolated
_ROUNDS_SECONDS = 0.05  # on a CPU, each step is timed for about this long (at least 3 rounds)


def _isotonic(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


def _line(points: list, x: float) -> float:
    """Piecewise-linear through ``points`` [(x, y)], sorted by x, read through their isotonic fit (a larger step
    never costs less: what says otherwise is timing noise); flat below the first. Past the last, extended with the
    steeper of the last segment's slope and the whole table's: a cost that only starts to grow (a GPU leaving its
    memory-bound regime) grows at least as fast further on, and a noisy last segment does not make it flat."""
    ys = _isotonic([p[1] for p in points])
    xs = [p[0] for p in points]
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x > xs[-1]:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), (ys[-1] - ys[0]) / (xs[-1] - xs[0]))
        return ys[-1] + slope * (x - xs[-1])
    i = min(sum(v <= x for v in xs) - 1, len(xs) - 2)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


@dataclass(frozen=True)
class CycleCosts:
    """Seconds of the engine's steps at one batch size on this machine (``probe``)."""

    batch: int
    verify: tuple  # ((tokens per row, seconds), ...): the verify forward and the acceptance
    draft: tuple  # ((top_k, first level, each further level), ...)
    update: tuple  # ((slots kept, seconds), ...)
    advance: float  # the update of a cycle without a tree

    def step_seconds(self, tree: TreeConfig) -> float:
        """The steps of one cycle drafting ``tree`` (the host's share of a cycle is not in here)."""
        if not tree.drafts:
            return _line(self.verify, 1) + self.advance
        firsts = [(k, f) for k, f, _ in self.draft]
        levels = [(k, lv) for k, _, lv in self.draft]
        draft = _line(firsts, tree.top_k) + (tree.depth - 1) * _line(levels, tree.top_k)
        return _line(self.verify, tree.total_tokens + 1) + draft + _line(self.update, tree.depth + 1)

    def as_json(self) -> dict:
        return {"batch": self.batch, "verify": [list(p) for p in self.verify], "draft": [list(p) for p in self.draft],
                "update": [list(p) for p in self.update], "advance": self.advance}

    @classmethod
    def from_json(cls, d) -> "CycleCosts":
        """Validated: ValueError naming what is wrong (a file is data, and may be damaged)."""
        if not isinstance(d, dict) or set(d) != {"batch", "verify", "draft", "update", "advance"}:
            raise ValueError(f"expected the fields of CycleCosts, got {sorted(d) if isinstance(d, dict) else d!r}")
        batch = d["batch"]
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        tables = {}
        for name, width in (("verify", 2), ("draft", 3), ("update", 2)):
            rows = d[name]
            if not isinstance(rows, list) or not rows or any(not isinstance(r, list) or len(r) != width for r in rows):
                raise ValueError(f"{name} must be a non-empty list of [size, seconds...] rows, got {rows!r}")
            for r in rows:
                if isinstance(r[0], bool) or not isinstance(r[0], int) or r[0] < 1:
                    raise ValueError(f"{name}: size {r[0]!r} is not a positive int")
                for s in r[1:]:
                    _check_seconds(f"{name} at {r[0]}", s)
            if [r[0] for r in rows] != sorted({r[0] for r in rows}):
                raise ValueError(f"{name}: sizes {[r[0] for r in rows]} are not increasing")
            tables[name] = tuple(tuple(r) for r in rows)
        _check_seconds("advance", d["advance"])
        return cls(batch, tables["verify"], tables["draft"], tables["update"], float(d["advance"]))


def _check_seconds(what: str, s) -> None:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s < 60:
        raise ValueError(f"{what}: {s!r} is not a number of seconds")


def cycle_seconds(table: dict, batch: int, tree: TreeConfig) -> float:
    """Seconds of the steps of a cycle of ``tree`` at ``batch`` rows from ``table`` {batch: CycleCosts}: linear
    between the measured batches around it, the nearest one's beyond them."""
    sizes = sorted(table)
    lo = max((b for b in sizes if b <= batch), default=sizes[0])
    hi = min((b for b in sizes if b >= batch), default=sizes[-1])
    f = {b: table[b].step_seconds(tree) for b in {lo, hi}}
    return f[lo] if lo == hi else f[lo] + (f[hi] - f[lo]) * (batch - lo) / (hi - lo)


def _probe_tree(q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents and depths (q,) of a tree of q nodes: a chain of up to 8 levels below the root, the rest on level 1."""
    i = torch.arange(q, device=device)
    chain = i <= 8
    return torch.where(chain, (i - 1).clamp(min=0), torch.zeros_like(i)), torch.where(chain, i, torch.ones_like(i))


class _Timer:
    """One step to time: called once (the warm-up: lazy allocations, kernel compilation), then on CUDA captured as a
    CUDA graph and replayed, as the engine's steps run there, else called eagerly; ``after``, if given, runs eagerly
    after it each time (what the engine launches from the host, as the greedy acceptance). ``best``: the fastest
    round so far (a busy machine only ever adds time)."""

    def __init__(self, fn, cuda: bool, after=None):
        fn()
        self.run, self.after, self.inner, self.cuda, self.best = fn, after or (lambda: None), 1, cuda, float("inf")
        self.after()
        if cuda:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                fn()
            self.run, self.inner = self.graph.replay, 4

    def round(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(self.inner):
            self.run()
            self.after()
        if self.cuda:
            torch.cuda.synchronize()
        took = (time.perf_counter() - t0) / self.inner
        self.best = min(self.best, took)
        return took


def _timed(timers: list) -> list[float]:
    """The best round of each timer, the timers taking turns round by round (a slow spell of a shared machine then
    falls on all of them, not on one): 3 rounds on CUDA, on a CPU as many as fit in ``_ROUNDS_SECONDS`` per timer
    (at least 3, at most 20)."""
    start, rounds = time.perf_counter(), 0
    cuda = timers[0].cuda
    budget = _ROUNDS_SECONDS * len(timers)
    while rounds < 3 or (not cuda and rounds < 20 and time.perf_counter() - start < budget):
        for t in timers:
            t.round()
        rounds += 1
    return [t.best for t in timers]


@torch.no_grad()
def probe(model, head, cap, kinds, batch: int, *, sampler=None, mrope: bool = False) -> CycleCosts:
    """Time the engine's steps at ``batch`` rows on the model's device (random tokens over ``PREFIX`` cached ones).

    ``cap``: the call's ``FeatureCapture``; ``kinds``: the target's layer kinds (``masks.layer_kinds``);
    ``sampler``: the call's ``DraftSampler`` when sampling (the draft and the acceptance then run its way);
    ``mrope``: the target takes three position axes (Qwen2-VL family). Nothing of the engine's own state is touched.
    """
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    # On CUDA the graphs are captured on the model's GPU, whichever is current; on a CPU the linears run as the
    # engine's eager cycles run them.
    with torch.cuda.device(dev) if cuda else skinny_linears(model, head):
        setup = _Probe(model, head, cap, kinds, batch, sampler, mrope)
        verify = setup.verify_costs()
        draft = setup.draft_costs()
        *update, advance = _timed([_Timer(setup.update_fn(k), cuda) for k in _KEPT] + [_Timer(setup.advance_fn(), cuda)])
    return CycleCosts(batch, verify, draft, tuple(zip(_KEPT, update)), advance)


class _Probe:
    """The tensors the probed steps read and write: a static target cache of ``PREFIX`` cached tokens and room for
    a tree, and the head's cache and root buffers as ``fixed.Buffers`` holds them."""

    def __init__(self, model, head, cap, kinds, batch, sampler, mrope):
        from transformers.cache_utils import Cache, StaticLayer

        self.model, self.head, self.cap, self.kinds, self.B, self.mrope = model, head, cap, kinds, batch, mrope
        self.sampler = sampler.for_graphs() if sampler is not None else None
        self.dev = dev = next(model.parameters()).device
        self.cuda, self.kwarg = dev.type == "cuda", cache_kwarg(model)
        B, P, g = batch, PREFIX, torch.Generator().manual_seed(0)
        self.V = model.config.get_text_config().vocab_size
        self.length = L = P + max(_QS) + max(_KEPT) + 1
        self.cache = Cache(layers=[StaticLayer(max_cache_len=L) for _ in kinds])
        ids = torch.randint(min(self.V, 1000), (B, P), generator=g).to(dev)
        self.slot_pos = torch.full((B, L), -1, dtype=torch.long, device=dev)
        pos = torch.arange(P, device=dev).expand(B, P)
        _, feats = prefill_step(model, self.cache, kinds, self.kwarg, cap, ids, pos, self.slot_pos,
                                torch.arange(P, device=dev), self._positions(pos))
        self.slot_pos[:, :P] = pos
        self.layers = [la for la in self.cache.layers if la.is_initialized]
        self.F = feats.shape[-1]
        hc, out, logits = extend_head(head, None, feats, ids, pos)
        self.scratch = scratch_slots(max(_KS), 2)  # the probed drafts are at most 2 levels deep
        nkv, hd, hdv = hc.k.shape[1], hc.k.shape[3], hc.v.shape[3]
        self.head_k = hc.k.new_zeros(B, nkv, L + self.scratch, hd)
        self.head_v = hc.v.new_zeros(B, nkv, L + self.scratch, hdv)
        self.head_k[:, :, :P], self.head_v[:, :, :P] = hc.k, hc.v
        self.head_pos = torch.full((B, L), -1, dtype=torch.long, device=dev)
        self.head_pos[:, :P] = pos
        self.root, self.root_pos = ids[:, -1].clone(), torch.full((B,), P, dtype=torch.long, device=dev)
        self.root_out, self.root_logits = out[:, -1].clone(), logits[:, -1].clone()
        self.cur = torch.tensor(P, device=dev)
        self.gen = g

    def _positions(self, pos):
        return pos[None].expand(3, -1, -1) if self.mrope else pos

    def _tree(self, q: int):
        B, dev = self.B, self.dev
        parent, depth = (t.expand(B, -1).contiguous() for t in _probe_tree(q, dev))
        tokens = torch.randint(min(self.V, 1000), (B, q), generator=self.gen).to(dev)
        return Tree(tokens, parent, depth), PREFIX + depth

    def verify_timer(self, q: int) -> _Timer:
        """The verify forward over q tokens per row and the acceptance: sampled, captured with it (as the engine's
        ``accept_step``); greedy, launched after it from the host (as the engine does)."""
        tree, q_pos = self._tree(q)
        D, P, dev = int(tree.depth.max()), PREFIX, self.dev
        write, positions = torch.arange(P, P + q, device=dev), self._positions(q_pos)
        s, out = self.sampler, [None]
        if s is not None:
            q_nodes = torch.full((self.B, q, self.V), 1.0 / self.V, device=dev)
            u, e = walk_noise(torch.empty(self.B, q, device=dev), torch.empty(self.B, self.V, device=dev), None)

        def run():
            for la in self.layers:
                la.cumulative_length.fill_(P)
            out[0], _ = verify_step(self.model, self.cache, self.kinds, self.kwarg, self.cap, tree.tokens, q_pos,
                                    tree.parent, self.slot_pos, write, positions, D)
            if s is not None:
                accept(tree, out[0], q_nodes, s.warpers, [], D, None, noise=(u, e))

        greedy = None if s is not None else (lambda: accept(tree, out[0], None, None, [], D, None))
        return _Timer(run, self.cuda, greedy)

    def verify_costs(self) -> tuple:
        """(tokens per row, seconds) from 1 up: until a first round says the verify costs ``_STEEP`` times the
        1-token one (no bigger tree can pay there), or the batch's tokens reach the device's limit (the table
        extrapolates beyond); then every size timed again, in turns."""
        timers, cap = [], _MAX_TOKENS["cuda" if self.cuda else "cpu"]
        for q in _QS:
            timers.append(self.verify_timer(q))
            timers[-1].round()
            timers[-1].round()  # two rounds before deciding: one can be a slow spell's
            if (q >= 8 and timers[-1].best > _STEEP * timers[0].best) or self.B * q * 2 > cap:
                break
        return tuple(zip(_QS, _timed(timers)))

    def draft_fn(self, k: int, depth: int):
        B, dev, s = self.B, self.dev, self.sampler
        total = min(k + (depth - 1) * k * k, 4 * k)
        q = total + 1
        outs = [torch.zeros(B, q, dtype=torch.long, device=dev) for _ in range(4)]
        q_nodes = noise = None
        if s is not None:
            q_nodes = torch.zeros(B, q, s.vocab_size, device=dev)
            noise = draft_noise(torch.empty(B, 1 + self.scratch, s.width, device=dev), None)

        def run():
            draft_step(self.head, self.head_k, self.head_v, self.head_pos, self.root, self.root_pos, self.root_out,
                       self.root_logits, *outs, q_nodes, noise, s, k, depth, total)
        return run

    def draft_costs(self) -> tuple:
        """(top_k, first level, each further level): from drafts of depth 1 and 2."""
        vd = getattr(self.head.config, "draft_vocab_size", None) or self.head.config.vocab_size
        ks = [k for k in _KS if k <= vd]
        best = _timed([_Timer(self.draft_fn(k, d), self.cuda) for k in ks for d in (1, 2)])
        return tuple((k, one, max(two - one, 0.0)) for k, one, two in zip(ks, best[::2], best[1::2]))

    def update_fn(self, kept: int):
        B, dev, P = self.B, self.dev, PREFIX
        tree, q_pos = self._tree(kept + 1)
        feats = torch.randn(B, kept + 1, self.F, generator=self.gen).to(dev, self.root_out.dtype)
        accept_len = torch.full((B,), kept - 1, dtype=torch.long, device=dev)
        path = torch.arange(kept, device=dev).expand(B, -1).contiguous()  # the probe tree's chain
        bonus = self.root[:, None].clone()
        keys, values = [la.keys for la in self.layers], [la.values for la in self.layers]
        lengths = [la.cumulative_length for la in self.layers]

        def run():
            self.cur.fill_(P)
            update_step(self.head, keys, values, lengths, self.slot_pos, self.head_k, self.head_v, self.head_pos,
                        self.cur, self.root, self.root_pos, self.root_out, self.root_logits, tree.tokens, q_pos, feats,
                        accept_len, path, bonus)
        return run

    def advance_fn(self):
        bonus, lengths = self.root[:, None].clone(), [la.cumulative_length for la in self.layers]

        def run():
            self.cur.fill_(PREFIX)
            advance_step(lengths, self.slot_pos, self.cur, self.root, self.root_pos, bonus)
        return run
