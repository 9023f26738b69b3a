"""What a decode cycle costs on this machine, by tree shape and batch: measured once, then read from a table.

A cycle of the engine (``storage.py``, ``steps.py``) with a tree of depth d, top_k k and N nodes runs
  verify(N + 1)  the target's forward over the root and the N nodes of every row, and the acceptance;
  draft(k, d)    the head's first level (from the root's logits) and d - 1 further levels over k nodes each;
  update(d + 1)  keeping the accepted path in both caches and running the head over it;
and a cycle without a tree (``TreeConfig.none()``) verify(1) and ``advance``. ``probe`` times each of these steps
as the engine runs them: the same step functions (``steps.py``) over a storage of their own, captured as CUDA graphs
(``graphs.OwnGraph``) and replayed where the call's steps are, else eager, for a handful of sizes, and ``CycleCosts``
interpolates between them. On a CPU the verify is timed with ``skinny.py``'s few-row linears and without: the faster
is kept, and the loop runs the verify and the update of that many tokens per row the same way (on this project's CPU
the few-row product wins; on another machine's BLAS it may not).
What the host does around the steps per cycle (committing tokens, stopping checks, the host read) is not probed:
the chooser learns it from the cycles it watches (``chooser.Chooser.overhead``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from ..config import TreeConfig
from ..hf.cache import set_pointers
from ..hf.compat import cache_kwarg
from ..hf.parts import resolve_target
from .draft import head_entries, scratch_slots
from .graphs import OwnGraph
from .masks import layer_kinds
from .sampling import draft_noise, walk_noise
from .skinny import for_rows, skinny_linears
from .steps import accept_step, advance_step, draft_step, prefill_step, update_step, verify_step
from .storage import Storage

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
    # Tokens per row (of ``verify``'s sizes) at which the verify ran faster with ``skinny.py``'s few-row linears
    # than without them (a CPU; measured, since which is faster depends on the machine's BLAS).
    skinny: tuple = ()
    # tree -> step_seconds(tree): the chooser ranks a few hundred trees per choice, each read through the tables' fits
    _seconds: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def few_row_linears(self, q: int) -> bool:
        """Whether a forward of ``q`` tokens per row runs with the few-row linears: as the verify measured at the
        largest probed size up to ``q``."""
        probed = [n for n, _ in self.verify if n <= q] or [self.verify[0][0]]
        return probed[-1] in self.skinny

    def step_seconds(self, tree: TreeConfig) -> float:
        """The steps of one cycle drafting ``tree`` (the host's share of a cycle is not in here)."""
        seconds = self._seconds.get(tree)
        if seconds is not None:
            return seconds
        if not tree.drafts:
            seconds = _line(self.verify, 1) + self.advance
        else:
            firsts = [(k, f) for k, f, _ in self.draft]
            levels = [(k, lv) for k, _, lv in self.draft]
            draft = _line(firsts, tree.top_k) + (tree.depth - 1) * _line(levels, tree.top_k)
            seconds = _line(self.verify, tree.total_tokens + 1) + draft + _line(self.update, tree.depth + 1)
        self._seconds[tree] = seconds
        return seconds

    def as_json(self) -> dict:
        return {"batch": self.batch, "verify": [list(p) for p in self.verify], "draft": [list(p) for p in self.draft],
                "update": [list(p) for p in self.update], "advance": self.advance, "skinny": list(self.skinny)}

    @classmethod
    def from_json(cls, d) -> "CycleCosts":
        """Validated: ValueError naming what is wrong (a file is data, and may be damaged)."""
        if not isinstance(d, dict) or set(d) != {"batch", "verify", "draft", "update", "advance", "skinny"}:
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
        sizes = {r[0] for r in tables["verify"]}
        if not isinstance(d["skinny"], list) or any(q not in sizes or isinstance(q, bool) for q in d["skinny"]):
            raise ValueError(f"skinny must list verify sizes {sorted(sizes)}, got {d['skinny']!r}")
        return cls(batch, tables["verify"], tables["draft"], tables["update"], float(d["advance"]),
                   tuple(d["skinny"]))


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
    """Parents and depths (q,) of a tree of q nodes: a chain of up to 8 levels below the root, the rest on level 1.
    A node's parent and depth do not depend on q: the first nodes of the tree are a tree too."""
    i = torch.arange(q, device=device)
    chain = i <= 8
    return torch.where(chain, (i - 1).clamp(min=0), torch.zeros_like(i)), torch.where(chain, i, torch.ones_like(i))


class _Timer:
    """One step to time: called once (the warm-up: lazy allocations, kernel compilation), then, where the call's steps
    are captured, captured as a CUDA graph (``graphs.OwnGraph``) and replayed, else called eagerly.
    ``best``: the fastest round so far (a busy machine only ever adds time); ``rounds``: how many. On a CPU the warm-up
    is a round too: an eager step has nothing to compile, and its lazy allocations only make that round slower, which
    the fastest round leaves out."""

    def __init__(self, fn, device: torch.device, graphs: bool):
        self.cuda, self.best, self.rounds = device.type == "cuda", float("inf"), 0
        self.run = OwnGraph(fn, "probed step", device=device) if graphs else fn
        self.inner = 4 if graphs else 1
        if self.cuda:
            for _ in range(2 if graphs else 1):  # the warm-up, then (graphs) the capture
                self.run()
        else:
            self.round()

    def round(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(self.inner):
            self.run()
        if self.cuda:
            torch.cuda.synchronize()
        took = (time.perf_counter() - t0) / self.inner
        self.best, self.rounds = min(self.best, took), self.rounds + 1
        return took


def _timed(timers: list) -> list[float]:
    """The best round of each timer, the timers taking turns round by round (a slow spell of a shared machine then
    falls on all of them, not on one): 3 turns on CUDA; on a CPU at least one, until every timer has 3 rounds (those
    it ran before count: a 135M-parameter model's probe took 7.4 s with 3 turns after them, most of its first call),
    then more while they fit in ``_ROUNDS_SECONDS`` per timer (20 turns at most)."""
    start, turns = time.perf_counter(), 0
    cuda = timers[0].cuda
    budget = _ROUNDS_SECONDS * len(timers)

    def more() -> bool:
        if cuda:
            return turns < 3
        if turns < 1 or min(t.rounds for t in timers) < 3:
            return True
        return turns < 20 and time.perf_counter() - start < budget

    while more():
        for t in timers:
            t.round()
        turns += 1
    return [t.best for t in timers]


@torch.no_grad()
def probe(model, head, cap, batch: int, *, device, sampler=None, graphs: bool = False,
          mrope: bool = False) -> CycleCosts:
    """Time the engine's steps at ``batch`` rows on ``device`` (random tokens over ``PREFIX`` cached ones).

    ``cap``: the call's ``FeatureCapture``; ``sampler``: the call's ``DraftSampler`` when sampling (the draft and the
    acceptance then run its way); ``graphs``: the steps replay as CUDA graphs, as the call's do; ``mrope``: the target
    takes three position axes (Qwen2-VL family). The probe has a storage of its own: the decoder's is untouched.
    """
    device = torch.device(device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        setup = _Probe(model, head, cap, batch, device, sampler, graphs, mrope)
        verify, skinny = setup.verify_costs()
        draft = setup.draft_costs()
        costs = CycleCosts(batch, verify, draft, (), 0.0, skinny)
        *update, advance = _timed([setup.timer(setup.update_fn(k, costs.few_row_linears(k))) for k in _KEPT]
                                  + [setup.timer(setup.advance_fn())])
    return dataclasses.replace(costs, update=tuple(zip(_KEPT, update)), advance=advance)


class _Probe:
    """The probed steps' storage: a static target cache of ``PREFIX`` cached tokens and room for a tree, and the head's
    buffers sized for the largest tree probed, whose first columns hold every smaller tree."""

    def __init__(self, model, head, cap, batch, device, sampler, graphs, mrope):
        self.model, self.head, self.cap, self.B, self.mrope = model, head, cap, batch, mrope
        # The sampler the engine's steps are keyed on has no generator: their noise is drawn outside them.
        self.dev, self.graphs = device, graphs
        self.sampler = dataclasses.replace(sampler, generator=None) if sampler is not None else None
        # As the loop runs them: a CPU's eager verify and update with the few-row linears, the draft without.
        self.linears = skinny_linears() if device.type == "cpu" else contextlib.nullcontext()
        parts = resolve_target(model)
        B, P, g = batch, PREFIX, torch.Generator().manual_seed(0)
        self.V = parts.vocab_size
        L = P + max(_QS) + max(_KEPT) + 1
        self.store = store = Storage()
        store.prepare(parts.num_layers, B, L, L, tuple(layer_kinds(parts.text_config, parts.num_layers)),
                      cache_kwarg(model), eager=False, grows=False)
        self.gen = g
        ids = torch.randint(min(self.V, 1000), (B, P), generator=g).to(device)
        pos = torch.arange(P, device=device).expand(B, P)
        target = store.positions(pos)
        _, feats = prefill_step(model, target, cap, ids, pos, torch.arange(P, device=device), self._positions(pos))
        self.F = feats.shape[-1]
        out, logits, (k, v) = head_entries(head, None, feats, ids, pos)
        store.set_tree(TreeConfig(2, max(_KS), max(_QS) - 1))  # the largest probed tree's nodes and scratch slots
        store.start(k, v, pos, ids[:, -1], torch.full((B,), P, device=device), out[:, -1], logits[:, -1],
                    scratch=scratch_slots(max(_KS), 2), q_len=max(_QS),
                    vocab=sampler.vocab_size if sampler is not None else None,
                    width=sampler.width if sampler is not None else None)
        buf = store.full
        parent, depth = _probe_tree(max(_QS), device)
        buf.tokens.copy_(torch.randint(min(self.V, 1000), (B, max(_QS)), generator=g).to(device))
        buf.parent.copy_(parent.expand(B, -1))
        buf.depth.copy_(depth.expand(B, -1))
        buf.q_pos.copy_(P + buf.depth)
        if sampler is not None:  # noise from a generator of the probe's own: the call's draws are left as they are
            noise = torch.Generator(device).manual_seed(1)
            buf.q_nodes.fill_(1.0 / self.V)
            walk_noise(buf.u, buf.e, noise)
            draft_noise(buf.noise, noise)

    def timer(self, fn) -> _Timer:
        return _Timer(fn, self.dev, self.graphs)

    def _positions(self, pos):
        return pos[None].expand(3, -1, -1) if self.mrope else pos

    def verify_timer(self, q: int, linears=None) -> _Timer:
        """The verify forward over q tokens per row and the acceptance (``accept_step``, captured with it; the engine
        captures the two apart, and launches greedy's eagerly where no processor applies: the same kernels, from the
        host). ``linears``: the context its forward runs in (default: the few-row linears on a CPU, where they
        apply)."""
        linears = for_rows(self.linears, self.B * q) if linears is None else linears
        buf = self.store.full.for_tree(q, 0)
        D, P = min(q - 1, 8), PREFIX
        write, positions = torch.arange(P, P + q, device=self.dev), self._positions(buf.q_pos)
        target, s, out = self.store.target, self.sampler, [None]

        def run():
            set_pointers(target.cache, P)
            with linears:
                out[0], _ = verify_step(self.model, target, buf, self.cap, write, positions, D)
            accept_step(buf, out[0], s is not None, D, tuple(s.warpers) if s is not None else ())

        return self.timer(run)

    def verify_costs(self) -> tuple[tuple, tuple]:
        """((tokens per row, seconds), ...) from 1 up: until a first round says the verify costs ``_STEEP`` times the
        1-token one (no bigger tree can pay there), or the batch's tokens reach the device's limit (the table
        extrapolates beyond); then every size timed again, in turns. On a CPU each size of more than one row is also
        timed without the few-row linears, and keeps the faster (the second item: the sizes where they won)."""
        timers, cap = [], _MAX_TOKENS["cuda" if self.dev.type == "cuda" else "cpu"]
        both = self.dev.type == "cpu"
        for q in _QS:
            pair = [self.verify_timer(q)]
            if both and self.B * q > 1:
                pair.append(self.verify_timer(q, contextlib.nullcontext()))
            for t in pair:
                t.round()
                t.round()  # two rounds before deciding: one can be a slow spell's
            timers.append(pair)
            best = min(t.best for t in pair)
            if (q >= 8 and best > _STEEP * min(t.best for t in timers[0])) or self.B * q * 2 > cap:
                break
        flat = _timed([t for pair in timers for t in pair])
        seconds, skinny, i = [], [], 0
        for q, pair in zip(_QS, timers):
            mine = flat[i:i + len(pair)]
            i += len(pair)
            seconds.append((q, min(mine)))
            if len(mine) == 2 and mine[0] < mine[1]:
                skinny.append(q)
        return tuple(seconds), tuple(skinny)

    def draft_fn(self, k: int, depth: int):
        total = min(k + (depth - 1) * k * k, 4 * k)
        buf = self.store.full.for_tree(total + 1, scratch_slots(k, depth))
        return lambda: draft_step(self.head, buf, self.sampler, k, depth, total)

    def draft_costs(self) -> tuple:
        """(top_k, first level, each further level): from drafts of depth 1 and 2."""
        vd = getattr(self.head.config, "draft_vocab_size", None) or self.head.config.vocab_size
        ks = [k for k in _KS if k <= vd]
        best = _timed([self.timer(self.draft_fn(k, d)) for k in ks for d in (1, 2)])
        return tuple((k, one, max(two - one, 0.0)) for k, one, two in zip(ks, best[::2], best[1::2]))

    def update_fn(self, kept: int, few_rows: bool = True):
        """The update keeping ``kept`` slots of the probe tree's chain (``few_rows``: with the few-row linears, where
        the verify of as many tokens measured them faster)."""
        linears = self.linears if few_rows else contextlib.nullcontext()
        B, dev, buf, target = self.B, self.dev, self.store.full, self.store.target
        feats = torch.randn(B, max(_QS), self.F, generator=self.gen).to(dev, buf.root_out.dtype)
        accept_len = torch.full((B,), kept - 1, dtype=torch.long, device=dev)
        path = torch.arange(kept, device=dev).expand(B, -1).contiguous()
        bonus = buf.root[:, None].clone()

        def run():
            buf.cur.fill_(PREFIX)
            with linears:
                update_step(self.head, target, buf, feats, accept_len, path, bonus)
        return run

    def advance_fn(self):
        buf, target = self.store.full, self.store.target
        bonus = buf.root[:, None].clone()

        def run():
            buf.cur.fill_(PREFIX)
            advance_step(target, buf, bonus)
        return run
