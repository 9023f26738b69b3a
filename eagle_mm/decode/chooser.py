"""The default call's draft tree, or no tree, chosen from what a cycle costs here and what the head gets accepted.

A tree commits E[L] tokens per row and cycle (``acceptance.py``: from three numbers fitted to what decoding
observes) and a cycle costs T seconds at the batch that runs (``costs.py``: the engine's steps, probed once per
machine, model and batch and kept on disk by ``cost_cache.py``, plus the host's share per cycle, learned from the
cycles watched). The chooser takes the tree with the most tokens per second, E[L] / T, over a grid of chains and
trees and ``TreeConfig.none()``, which commits one token per cycle at the cost of one target forward: where no
tree can pay, the call decodes as ``generate`` does, through the same captured steps.

One ``Chooser`` per decoder (model, head, device: ``Decoder.chooser``) keeps what every call learns: the costs, the
acceptance per decoding setting, the host's share per cycle, the calls' straggling and realized times, the CUDA
graphs the runner holds (mirrored: ``graphs.MAX_GRAPHS`` per step), and for compiled calls the tree each batch size
and decoding kind got (a new tree shape would be a new compile; greedy and sampled steps compile apart). A call's choices are a ``Session``
(``session.py``).
"""
from __future__ import annotations

import collections
import functools
import logging
import statistics
import time
from dataclasses import dataclass

from ..config import TreeConfig
from .acceptance import Acceptance
from .cost_cache import CostFile, cost_key, decode_kind, entry_name
from .costs import CycleCosts, cycle_seconds, probe
from .graphs import MAX_GRAPHS

logger = logging.getLogger(__name__)

__all__ = ["Finalist", "TreeChoice", "Chooser", "candidate_trees", "rank_trees", "setting_of", "MAX_TOP_K"]

_TOTALS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_TOP_KS = (2, 4, 6, 8)
MAX_TOP_K = max(_TOP_KS)
_CAPTURE_PRIOR = 0.15  # seconds a tree's capture at a new batch is taken to cost before one has been watched
# (H100, code-tiny: a default call's path of five batches captured in 0.87 s, one of seven in 0.79 s)


def candidate_trees(max_depth: int = 8, max_top_k: int = 8) -> list[TreeConfig]:
    """No tree, chains of depth 1..max_depth, and trees of every top_k, depth and size of the grid (at least as many
    nodes as levels: a level that cannot hold a node is a head forward for nothing)."""
    return list(_candidates(max_depth, max_top_k))


@functools.lru_cache(maxsize=64)
def _candidates(max_depth: int, max_top_k: int) -> tuple[TreeConfig, ...]:
    # Built once per (depth, top_k): a few hundred validated configs took 0.7 ms of every default call's start on
    # this project's CPU, a tenth of the chooser's host time in a greedy call (its cycles wait for the host on a GPU).
    trees = [TreeConfig.none()] + [TreeConfig.chain(d) for d in range(1, max_depth + 1)]
    for k in (k for k in _TOP_KS if k <= max_top_k):
        for d in range(1, max_depth + 1):
            trees += [TreeConfig(d, k, n) for n in _TOTALS if max(k, d) <= n <= k + (d - 1) * k * k]
    return tuple(trees)


def setting_of(gen) -> tuple:
    """What acceptance depends on besides the model and head: greedy, or sampling and its warpers."""
    if not gen.do_sample:
        return ("greedy", getattr(gen, "repetition_penalty", None))
    return ("sampled",) + tuple(getattr(gen, n, None) for n in ("temperature", "top_k", "top_p", "min_p",
                                                                "typical_p", "repetition_penalty"))


@dataclass(frozen=True)
class Finalist:
    tree: TreeConfig
    accept_length: float  # expected tokens per row and cycle, the target's own included
    cycle_seconds: float  # expected seconds per cycle at the batch chosen for
    capture_seconds: float = 0.0  # the CUDA-graph captures the choice charged to it (``Session._charge``)

    @property
    def tokens_per_second(self) -> float:
        """Per row: multiply by the batch for the call's rate."""
        return self.accept_length / self.cycle_seconds

    def as_dict(self) -> dict:
        return {"tree": [self.tree.depth, self.tree.top_k, self.tree.total_tokens],
                "accept_length": self.accept_length, "cycle_ms": 1e3 * self.cycle_seconds,
                "tokens_per_second_per_row": self.tokens_per_second, "capture_s": self.capture_seconds}


@dataclass(frozen=True)
class TreeChoice:
    """What the chooser decided for a batch, and why: the best trees' expected rates, best first."""

    tree: TreeConfig
    batch: int
    why: str  # "first", "rows finished", "acceptance or costs moved", "kept (compiled)",
    # "no tree for the last tokens, to measure it here", "a tree again: its acceptance is thinly measured"
    finalists: tuple  # (Finalist, ...): the chosen, the best few, no tree, and the tree that ran before
    acceptance: tuple  # the fitted (a, t, c) of ``acceptance.py``
    cycle: int = 0  # the call's cycle from which the tree ran

    def as_dict(self) -> dict:
        return {"tree": [self.tree.depth, self.tree.top_k, self.tree.total_tokens], "batch": self.batch,
                "why": self.why, "cycle": self.cycle, "acceptance": list(self.acceptance),
                "finalists": [f.as_dict() for f in self.finalists]}

    def __str__(self) -> str:
        rates = "; ".join(f"{_name(f.tree)}: {f.accept_length:.2f} tok x {self.batch} rows / "
                          f"{1e3 * f.cycle_seconds:.2f} ms = {self.batch * f.tokens_per_second:.0f} tok/s"
                          + (f" + {f.capture_seconds:.2f} s of captures" if f.capture_seconds else "")
                          for f in self.finalists)
        return f"{_name(self.tree)} at batch {self.batch} ({self.why}); expected {rates}"


def _name(tree: TreeConfig) -> str:
    if not tree.drafts:
        return "no tree"
    return f"chain {tree.depth}" if tree.top_k == 1 else f"tree {tree.depth}/{tree.top_k}/{tree.total_tokens}"


class Chooser:
    """Costs and acceptance for one (model, head, device), kept between calls by its decoder (``Decoder.chooser``)."""

    def __init__(self, model, head, device):
        self.device = device
        self.file = CostFile(cost_key(model, head, device))
        self.entries: dict[str, CycleCosts] = self.file.load()
        self.acceptance: dict[tuple, Acceptance] = {}
        # (kind, batch, drafts) -> seconds per cycle beyond the steps (learned), apart for cycles with and without a
        # tree: what a tree's cycles add (its commits, its head's steps as they run) says nothing of a plain one's
        self.overhead: dict[tuple, float] = {}
        self.residuals: dict[tuple, collections.deque] = {}  # the same keys -> the last cycles' share beyond the steps
        # (batch, mode, kind) -> the tree compiled calls keep. Greedy and sampled calls share the compiled verify and
        # update, but a shared tree chosen for greedy acceptance cost sampled calls more than the compile it saved
        # (this project's CPU, batch 1: 0.81x generate; its own tree 0.99x, its first call 25.8 s against 15.3)
        self.kept: dict[tuple, TreeConfig] = {}
        self.capacity: dict[tuple, TreeConfig] = {}  # (batch, kind) -> the capacity calls sized their buffers for
        self.last: dict[tuple, TreeConfig] = {}  # (batch, kind, setting) -> the tree chosen there last
        # CUDA graphs: the (kind, batch, tree) the runner holds graphs for, oldest first (its steps keep MAX_GRAPHS
        # signatures each), valid for the storage generation they were captured on; what captures took (seconds).
        self.held: collections.OrderedDict = collections.OrderedDict()
        self.generation = None
        self.captures: dict[str, collections.deque] = {}
        # (kind, batch, setting, drafts) -> recent calls' decode seconds over what their first choice predicted
        self.realized: dict[tuple, collections.deque] = {}
        # (kind, batch, setting) -> recent drafting calls' cycles over the longest row's tokens at their mean accepted
        # length: a batch decodes until its slowest row is done (code-tiny on an H100: 1.0 at batch 1, 1.5 at 4 and
        # 16, 1.8-2.1 at 32 and 64); counted, not timed, so a first call's too
        self.straggle: dict[tuple, collections.deque] = {}
        self.called: frozenset = frozenset()  # (kind, batch, setting, drafts) of the calls finished so far
        self.retried: set = set()  # (batch, kind, setting) where a tree ran again on thin acceptance (``Session``)
        # (kind, batch) -> (the table's costs, {tree: the steps' seconds of its cycle there (``cycle_seconds``)}): fixed
        # while the costs are, and a choice ranks a few hundred trees (``seconds``)
        self._steps: dict[tuple, tuple] = {}

    @property
    def on_gpu(self) -> bool:
        """Whether the steps run on a CUDA device (captured, waiting on the host), not eagerly on a CPU."""
        return self.device.type == "cuda"

    def sync(self, generation) -> None:
        """The decoder's storage is at ``generation``: graphs captured on an earlier one went with its memory."""
        if generation != self.generation:
            self.held.clear()
            self.generation = generation

    def hold(self, kind: str, batch: int, tree: TreeConfig) -> None:
        """``tree`` runs (is captured, or replayed) at ``batch``: the runner holds its graphs, the newest."""
        key = (kind, batch, tree)
        self.held[key] = None
        self.held.move_to_end(key)
        while len(self.held) > MAX_GRAPHS:
            self.held.popitem(last=False)

    def capture_seconds(self, kind: str) -> float:
        """What a tree's capture at a new batch costs: the median of those watched, a prior before any."""
        seen = self.captures.get(kind)
        return statistics.median(seen) if seen else _CAPTURE_PRIOR

    def ratio(self, kind: str, batch: int, setting: tuple, drafts: bool) -> float:
        """What calls of this kind at ``batch`` took over what was predicted for them, with a tree or without: the
        median of the last calls', drawn toward 1 as if one more call had matched its prediction (one slow call, a
        machine's busy spell or a first call's warm-up, moves the choice only halfway). On a CPU, trees not measured
        yet where calls without one were take those calls' ratio where it exceeds 1: there a cycle's time is its
        compute, and a drafting cycle does all that a plain one does, and more (this project's CPU at greedy batch 4:
        no tree measured at 1.1x its prediction, the trees priced at their probe alone drafted and lost at 0.71-0.78x
        generate's rate). Not on a GPU, where what a plain cycle takes beyond its prediction is mostly the host's
        fixed share, learned apart (``seconds``): scaled onto a tree's longer cycle it priced the tree out (an H100 at
        sampled batch 1: no tree measured at about 1.3x its prediction, and the later calls kept no tree at 0.74x the
        fixed tree's rate, dev/results/ab10_h100_2026-12-06)."""
        def of(d: bool) -> float | None:
            seen = self.realized.get((kind, batch, setting, d))
            return 1.0 + (statistics.median(seen) - 1.0) * len(seen) / (len(seen) + 1) if seen else None
        own = of(drafts)
        if own is not None:
            return own
        return max(1.0, of(False) or 1.0) if drafts and not self.on_gpu else 1.0

    def acceptance_for(self, setting: tuple) -> Acceptance:
        return self.acceptance.setdefault(setting, Acceptance())

    def table(self, kind: str) -> dict[int, CycleCosts]:
        """{batch: CycleCosts} measured for this decoding kind (``cost_cache.decode_kind``)."""
        return {c.batch: c for name, c in self.entries.items() if name.split("/")[1] == kind}

    def measure(self, model, head, cap, batches, sampler, graphs: bool, mrope: bool) -> None:
        """Probe the batches not measured yet for this kind, and keep the results on disk."""
        new = {}
        for b in batches:
            name = entry_name(b, decode_kind(sampler, graphs, self.device))
            if name not in self.entries:
                t0 = time.perf_counter()
                new[name] = probe(model, head, cap, b, device=self.device, sampler=sampler, graphs=graphs, mrope=mrope)
                logger.info("measured the engine's step costs at batch %d in %.2fs", b, time.perf_counter() - t0)
        if new:
            self.entries.update(new)
            self.file.save(new)

    def seconds(self, table: dict, kind: str, batch: int):
        """tree -> seconds of a cycle at ``batch``: the steps' from the table, and the host's share for cycles with a
        tree or without, learned at this batch, or at the nearest batch that decoded; where only cycles of the other
        sort have decoded, theirs on a GPU (0 before any has). Cycles without a tree learn their share only once they
        run: left at 0 beside a tree's learned share, they looked cheaper than they are, and calls whose first cycles
        drafted switched to no tree at their first review (the H200's first call at every batch above 1 did,
        dev/results/diag_h200_2026-12-06), the later calls keeping it. On a GPU both sorts of cycle wait on the host
        alike (the host's work is the loop's and the commit's); on a CPU a tree's share holds its head's host work
        too, which would overcharge a cycle without one: there a plain cycle's stays 0 until learned, and a tree's
        takes a plain cycle's (all of it is a tree's work too)."""
        def extra(drafts: bool) -> float | None:
            learned = [(abs(b.bit_length() - batch.bit_length()), abs(b - batch), v)
                       for (k, b, d), v in self.overhead.items() if k == kind and d == drafts]
            return min(learned)[2] if learned else None
        learned = {True: extra(True), False: extra(False)}
        borrows = {True: True, False: self.on_gpu}  # whether a cycle takes the other sort's share
        extras = {d: learned[d] if learned[d] is not None else (borrows[d] and learned[not d]) or 0.0
                  for d in (True, False)}
        steps = self.step_seconds(table, kind, batch)
        return lambda tree: steps(tree) + extras[tree.drafts]

    def step_seconds(self, table: dict, kind: str, batch: int):
        """tree -> the steps' seconds of its cycle at ``batch`` (``cycle_seconds``), each tree priced once while the
        costs stay the objects they are (measured or set anew: priced anew)."""
        costs = tuple(table[b] for b in sorted(table))
        held = self._steps.get((kind, batch))
        if held is None or len(held[0]) != len(costs) or any(a is not b for a, b in zip(held[0], costs)):
            held = self._steps[(kind, batch)] = (costs, {})
        steps = held[1]

        def of(tree: TreeConfig) -> float:
            s = steps.get(tree)
            if s is None:
                s = steps[tree] = cycle_seconds(table, batch, tree)
            return s
        return of

    def rank(self, lengths: dict, table: dict, kind: str, batch: int, setting: tuple = ()) -> list[Finalist]:
        """``lengths``' trees by expected rate at ``batch``, each cycle scaled by what calls of its kind realized, a
        drafting tree's tokens per cycle by the batch's straggling (``straggling``)."""
        base = self.seconds(table, kind, batch)
        ratio = {d: self.ratio(kind, batch, setting, d) for d in (True, False)}
        slow = self.straggling(kind, batch, setting)
        lengths = {t: n / slow if t.drafts else n for t, n in lengths.items()}
        return rank_trees(lengths, lambda tree: base(tree) * ratio[tree.drafts])

    def straggling(self, kind: str, batch: int, setting: tuple = ()) -> float:
        """How many more cycles than its mean acceptance says a drafting call at ``batch`` takes: the median of the
        last calls' (``straggle``); before any at ``batch``, the most of the smaller batches' (a batch waits for its
        slowest row, and more rows have a slower slowest: this project's CPU, straggling 1.5 measured at batch 4 and
        none at 16, drafted at 16 as if its rows kept pace and lost to generate; then measured 1.4 there); 1 before
        any."""
        seen = self.straggle.get((kind, batch, setting))
        if seen:
            return statistics.median(seen)
        below = [statistics.median(v) for (k, b, s), v in self.straggle.items()
                 if k == kind and s == setting and b < batch and v]
        return max(below, default=1.0)


def rank_trees(lengths: dict, seconds) -> list[Finalist]:
    """Every tree's expected tokens per second (per row), best first, ties to the smaller tree. ``lengths``:
    {tree: expected tokens per cycle}; ``seconds(tree)``: what a cycle of it costs."""
    out = [Finalist(t, n, seconds(t)) for t, n in lengths.items()]
    return sorted(out, key=lambda f: (-f.tokens_per_second, f.tree.total_tokens, f.tree.depth, f.tree.top_k))
