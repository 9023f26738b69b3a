"""The default call's draft tree, or no tree, chosen from what a cycle costs here and what the head gets accepted.

A tree commits E[L] tokens per row and cycle (``acceptance.py``: from three numbers fitted to what decoding
observes) and a cycle costs T seconds at the batch that runs (``costs.py``: the engine's steps, probed once per
machine, model and batch and kept on disk by ``cost_cache.py``, plus the host's share per cycle, learned from the
cycles watched). The chooser takes the tree with the most tokens per second, E[L] / T, over a grid of chains and
trees and ``TreeConfig.none()``, which commits one token per cycle at the cost of one target forward: where no
tree can pay, the call decodes as ``generate`` does, through the same captured steps.

One ``Chooser`` per decoder (model, head, device: ``Decoder.chooser``) keeps the costs, the acceptance per decoding
setting, and for compiled calls the tree each batch size got, whether greedy or sampled (a new tree shape would be
a new compile). A ``Session`` is one call: its first tree,
the capacity its buffers are sized for (every tree it may switch to: the same for every call of a batch, so that
later calls reuse the buffers and the graphs captured on them), and the choice made again when the batch shrinks
(rows finish) or the fitted acceptance moves the best tree clearly past the one running.

Where the steps replay as CUDA graphs, a tree not yet captured at a batch costs its capture once (measured: the
seconds the cycles that captured took beyond the steps). As rows finish, a call goes on at a smaller batch only where
it holds the graphs there or where the fewer rows save more than a capture over the tokens left
(``Session.shrink_pays``; a small target's call, which shrank at every power of two and captured at each, now
mostly keeps its batch), and there it keeps its tree (a new choice at each smaller batch made each call's path of
trees differ from the last one's, so that timed calls captured again). A choice is charged the capture at its own
batch only: a later shrink pays for itself. A call's first choice weighs the capture against what the tree would
save on ``_AMORTIZE`` calls' tokens (the graphs serve the calls after it too), a switch within the call against its
own tokens left. The chooser mirrors which (batch, tree) the runner holds graphs for (``graphs.MAX_GRAPHS`` per
step).

What the probe and the per-cycle share miss, each call measures. A batch's rows accept at different rates, so it
runs until its slowest row is done (code-tiny on an H100 at batch 64: 47 cycles for 128 tokens at 4.9 a cycle): a
drafting call's cycles over the longest row's tokens at its mean acceptance (``Chooser.straggle``, counted, so a first
call's too) divide a drafting tree's tokens per cycle at that batch. Its decode time against its first choice's
cycle times the cycles it ran (``Chooser.realized``, apart for calls with and without a tree) scales later
predictions of that kind at that batch and setting, so a tree that lost to the plain decode it was weighed against is
measured losing, and dropped. The first call of each kind, batch and setting in a process, and any call that captured
or compiled, is not counted there: it pays first-use costs (Triton builds, allocator growth) that later calls do not.
A plain decode is priced from the probe and a borrowed host share until it has run: where calls at a batch and
setting drafted and none decoded without a tree, the next call does, once, to measure it, unless a tree promises
``_MEASURE_PLAIN_BELOW`` times its rate.
"""
from __future__ import annotations

import collections
import logging
import statistics
import time
from dataclasses import dataclass, field, replace

from ..config import TreeConfig
from .acceptance import Acceptance
from .cost_cache import CostFile, cost_key, decode_kind, entry_name
from .costs import CycleCosts, cycle_seconds, probe
from .graphs import MAX_GRAPHS

logger = logging.getLogger(__name__)

__all__ = ["Finalist", "TreeChoice", "Chooser", "Session", "candidate_trees", "rank_trees", "setting_of", "MAX_TOP_K",
           "few_row_linears"]

_TOTALS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_TOP_KS = (2, 4, 6, 8)
MAX_TOP_K = max(_TOP_KS)
_SWITCH = 1.05  # within a call, a new tree must promise this much more than the running one
_REFIT_SECONDS = 0.5  # within a call, the choice is reviewed (acceptance fitted again) at most this often
_REFIT_CYCLES = 16  # ... and after this many cycles
_FINALISTS = 3
_CAPTURE_PRIOR = 0.15  # seconds a tree's capture at a new batch is taken to cost before one has been watched
# (H100, code-tiny: a default call's path of five batches captured in 0.87 s, one of seven in 0.79 s)
_AMORTIZE = 4  # a call's first choice counts a capture against this many calls' tokens: later calls replay it
_SAMPLED_BYTES = 1 << 30  # a sampled tree's proposals (batch x nodes x vocabulary, fp32) stay within this
_REALIZED_CALLS = 5  # the realized-time ratio is the median of the last calls' of its kind, batch and setting
_REALIZED_MIN_CYCLES = 4  # a call of fewer cycles says little of how a long one goes
# A first call at a batch and setting that drafted, and none without a tree yet: the next call decodes without one,
# once, to measure it, unless the best tree promises this many times its rate (an H100 matrix lost to HF's static
# generate at greedy batch 32 and 64 with trees, while the plain decode it never ran was priced at a tree's host share)
_MEASURE_PLAIN_BELOW = 2.0


def candidate_trees(max_depth: int = 8, max_top_k: int = 8) -> list[TreeConfig]:
    """No tree, chains of depth 1..max_depth, and trees of every top_k, depth and size of the grid (at least as many
    nodes as levels: a level that cannot hold a node is a head forward for nothing)."""
    trees = [TreeConfig.none()] + [TreeConfig.chain(d) for d in range(1, max_depth + 1)]
    for k in (k for k in _TOP_KS if k <= max_top_k):
        for d in range(1, max_depth + 1):
            trees += [TreeConfig(d, k, n) for n in _TOTALS if max(k, d) <= n <= k + (d - 1) * k * k]
    return trees


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
    why: str  # "first", "rows finished", "acceptance or costs moved", "kept (compiled)", "no tree, to measure it here"
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
        # (batch, mode) -> the tree compiled calls keep: greedy and sampled calls share the compiled verify and update
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
        return max(1.0, of(False) or 1.0) if drafts and self.device.type != "cuda" else 1.0

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
        borrow = self.device.type == "cuda"
        extras = {d: learned[d] if learned[d] is not None else ((borrow or d) and learned[not d]) or 0.0
                  for d in (True, False)}
        return lambda tree: cycle_seconds(table, batch, tree) + extras[tree.drafts]

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


@dataclass
class Session:
    """One call's choice: ``tree`` to start with, ``capacity`` to size the buffers for; ``next_tree`` before every
    cycle observes the last one (from the call's ``SpeculativeStats``) and says which tree runs next."""

    chooser: Chooser
    acceptance: Acceptance
    table: dict
    kind: str
    trees: list
    mode: str | None
    setting: tuple = ()
    tree: TreeConfig = field(default=None)
    capacity: TreeConfig = field(default=None)
    sampler: object = None
    choices: list = field(default_factory=list)
    _last: tuple = (0, 0, (), 0.0, 0.0)  # stats at the last look: forwards, drafts, accept counts, seconds, setup
    _batch: int = 0
    _fit_at: float = 0.0
    _cycles: int = 0  # cycles observed since the choice was last reviewed within the call
    idle: bool = False  # the call started without a tree: the head has no entries, nothing can be drafted
    _stale: bool = False  # the cycle just observed drafted from a head left as it was by cycles without a tree
    _steps: dict = field(default_factory=dict)  # (batch, tree) -> the probed steps' seconds per cycle
    captures: bool = False  # the steps replay as CUDA graphs: a tree new at a batch costs its capture
    remaining: int = 0  # new tokens per row the call has left to decode (at most)
    prompt_seconds: float = 0.0  # the head's pass over the prompt (the loop times it): a cost of drafting
    _plan: tuple | None = None  # the first choice: (batch, drafts, its cycle's seconds as the probe and host predict)
    _setup0: float | None = None  # the decoder's setup seconds at the first cycle
    _ran: dict = field(default_factory=dict)  # (batch, tree) -> the call's cycles that ran it (the realized ratio's)

    @classmethod
    def start(cls, chooser: Chooser, *, model, head, cap, batch: int, gen, sampler, mode, max_depth: int,
              max_top_k: int, shrinks: bool, mrope: bool = False) -> "Session":
        """Measure what is missing (this batch, and 1 when rows may finish), choose, size the capacity. ``shrinks``:
        the call goes on with fewer rows as they finish (else it keeps its tree: compiled steps). ``mode``: how the
        call's steps run (``options.choose_mode``): the costs are probed as CUDA graphs where it captures them.
        ``max_depth``: the new tokens the call decodes (the first choice weighs captures against them)."""
        graphs = mode is not None and chooser.device.type == "cuda"
        chooser.measure(model, head, cap, sorted({batch, 1} if shrinks else {batch}), sampler, graphs, mrope)
        setting = setting_of(gen)
        acceptance = chooser.acceptance_for(setting)
        kind = decode_kind(sampler, graphs, chooser.device)
        trees = candidate_trees(min(max_depth, 8), max_top_k)
        if sampler is not None:  # a sampled tree keeps each node's proposal over the vocabulary: bound its memory
            most = _SAMPLED_BYTES // (4 * batch * sampler.vocab_size) - 1
            trees = [t for t in trees if t.total_tokens <= most]
        s = cls(chooser, acceptance, chooser.table(kind), kind, trees, mode, setting, sampler=sampler,
                captures=mode == "graphs" and chooser.device.type == "cuda", remaining=max_depth)
        key = (batch, mode)
        if not shrinks and chooser.kept.get(key) in trees:  # compiled steps: the tree they were compiled for
            s.tree = s.capacity = chooser.kept[key]
            s.idle = not s.tree.drafts
            s.choices.append(TreeChoice(s.tree, batch, "kept (compiled)", (), acceptance.fit()))
            return s
        first = s._choose(batch, "first")
        s.tree, s._batch, s._fit_at = first.tree, batch, time.perf_counter()
        s._plan = (batch, first.tree.drafts, chooser.seconds(s.table, kind, batch)(first.tree))
        # A call that starts without a tree leaves the head out (no pass over the prompt: at a large batch on a CPU
        # it costs a fifth of the call), so it stays without one; the next call chooses again.
        s.idle = not first.tree.drafts
        if not shrinks:  # compiled steps: sized for the tree they are compiled for, which the call keeps
            s.capacity = chooser.kept[key] = first.tree
            return s
        # A call that never drafts: buffers for the root alone and a cache for the committed tokens only (one sized
        # for trees holds more slots, and every forward attends over them all: at batch 64 on the H200 a step took
        # 1.30 ms of GPU time against 1.20), unless an earlier call at this batch sized them for trees: a new size
        # allocates anew and captures every step again, and calls that went with and without a tree by turns did so
        # in every call (an H100 matrix ran greedy batch 16 at 0.71x HF static).
        held = chooser.capacity.get((batch, kind))
        if s.idle:
            s.capacity = held if held is not None else TreeConfig.none()
            return s
        # The buffers hold every candidate tree, whatever the acceptance: every call of this batch and kind sizes
        # them alike, so that it reuses the buffers and the graphs captured on them (a capacity that followed the
        # fitted acceptance grew from call to call, and each new size captured every step again). Never smaller than
        # an earlier call's (one of fewer new tokens has shallower candidates).
        s.capacity = chooser.capacity[(batch, kind)] = _envelope([held or TreeConfig.none(), first.tree] + trees)
        return s

    def shrink_pays(self, batch: int, rows: int, remaining: int) -> bool:
        """Under CUDA graphs, whether the call goes on at ``rows`` rows once rows finished (else at ``batch``, the
        finished rows decoding along unread): where the runner holds the tree's graphs there, or where the steps'
        saving over the ``remaining`` tokens per row outweighs a capture. A capture costs a small target's call far
        more than fewer rows save (an H100 matrix at greedy batch 16 captured at 8, 4, 2 and 1 rows in each call);
        a large target, whose step time follows its rows, still shrinks."""
        if not self.captures or (self.kind, rows, self.tree) in self.chooser.held:
            return True
        per_cycle = self.acceptance.expected_lengths([self.tree])[self.tree] if self.tree.drafts else 1.0
        saved = cycle_seconds(self.table, batch, self.tree) - cycle_seconds(self.table, rows, self.tree)
        return saved * remaining / max(per_cycle, 1.0) > self.chooser.capture_seconds(self.kind)

    def few_row_linears(self, batch: int, q: int) -> bool:
        """Whether a forward of ``q`` tokens per row at ``batch`` rows runs with ``skinny.py``'s few-row linears
        (``few_row_linears``)."""
        return few_row_linears(self.table, batch, q)

    def rank(self, batch: int, lengths: dict | None = None) -> list[Finalist]:
        """The trees (within the capacity, once sized) by expected rate at ``batch``, best first."""
        if lengths is None:
            trees = [t for t in self.trees if (self.capacity is None or t.fits(self.capacity))
                     and not (self.idle and t.drafts)]
            lengths = self.acceptance.expected_lengths(trees)
        return self.chooser.rank(lengths, self.table, self.kind, batch, self.setting)

    def _charge(self, batch: int):
        """tree -> the seconds its capture at ``batch`` would add to the call, where the runner holds no graphs of it
        there. Not at the smaller batches the call may go on with as rows finish: it goes there only where the
        fewer rows save more than the capture (``shrink_pays``). 0 where the steps are not captured, and where no
        tree's graphs are held at ``batch``: every candidate captures there, the rates decide."""
        c = self.chooser
        if not self.captures or not any(k == self.kind and b == batch for k, b, _ in c.held):
            return lambda tree: 0.0  # nothing held at this batch: every tree captures, its rate decides
        cost = c.capture_seconds(self.kind)
        return lambda tree: cost if (self.kind, batch, tree) not in c.held else 0.0

    def _charged(self, batch: int, ranked: list) -> list:
        """``ranked`` with each finalist's capture charge at ``batch`` (``_charge``) filled in."""
        charge = self._charge(batch)
        return [replace(f, capture_seconds=charge(f.tree)) for f in ranked]

    def _seconds_left(self, remaining: int, calls: int = 1):
        """Finalist (charged) -> the seconds ``calls`` calls of the ``remaining`` tokens per row would take with its
        tree, its captures included (once)."""
        return lambda f: calls * remaining * f.cycle_seconds / f.accept_length + f.capture_seconds

    def _choose(self, batch: int, why: str, cycle: int = 0) -> TreeChoice:
        """The tree that finishes the call's remaining tokens soonest at ``batch``, its capture included; the one the
        last call chose at this batch while it is within ``_SWITCH`` of it (another tree shape is another graph to
        capture, or to compile)."""
        ranked = self._charged(batch, self.rank(batch))
        key = (batch, self.kind, self.setting)
        left = self._seconds_left(self.remaining, _AMORTIZE if why == "first" else 1)
        best = min(ranked, key=left)  # ties: the faster rate, then the smaller tree (``ranked``'s order)
        last = next((f for f in ranked if f.tree == self.chooser.last.get(key)), None)
        if last is not None and left(last) <= _SWITCH * left(best):
            best = last
        plain = next((f for f in ranked if not f.tree.drafts), None)
        ran = lambda drafts: (self.kind, batch, self.setting, drafts) in self.chooser.called  # noqa: E731
        if (why == "first" and best.tree.drafts and plain is not None and ran(True) and not ran(False)
                and best.tokens_per_second < _MEASURE_PLAIN_BELOW * plain.tokens_per_second):
            best, why = plain, "no tree, to measure it here"  # once: its call is counted in ``called``
        self.chooser.last[key] = best.tree
        shown = [best] + ranked[:_FINALISTS] + [f for f in ranked if not f.tree.drafts or f.tree == self.tree]
        choice = TreeChoice(best.tree, batch, why, tuple(dict.fromkeys(shown)), self.acceptance.fit(), cycle)
        self.choices.append(choice)
        logger.info("draft tree: %s", choice)
        return choice

    def next_tree(self, batch: int, stats, setup: float, remaining: int | None = None,
                  generation=None) -> TreeConfig:
        """Observe the cycle since the last call, then the tree for the next cycle (the same one, or a new choice
        when the batch changed, or when the acceptance fitted again or the host's share learned since makes another
        tree finish the ``remaining`` tokens per row ``_SWITCH`` times sooner, its capture included). ``generation``:
        the storage's (``Storage.generation``), whose graphs the chooser mirrors. Compiled calls never switch."""
        self._observe(stats, setup)
        if self._setup0 is None:
            self._setup0 = setup
        if remaining is not None:
            self.remaining = remaining
        if self.captures:
            self.chooser.sync(generation)
        if self.mode in (None, "graphs"):  # compiled calls keep their tree
            now = time.perf_counter()
            why = None
            if batch != self._batch and self.captures:  # the call keeps its tree, whose captures its choice counted
                self._batch = batch
            elif batch != self._batch:
                why = "rows finished"
            elif self._cycles >= _REFIT_CYCLES and now - self._fit_at >= _REFIT_SECONDS:
                self._fit_at, self._cycles = now, 0
                ranked = self._charged(batch, self.rank(batch))
                left = self._seconds_left(self.remaining)
                running = next(f for f in ranked if f.tree == self.tree)
                best = min(ranked, key=left)
                if best.tree != self.tree and left(running) > _SWITCH * left(best):
                    why = "acceptance or costs moved"
            if why is not None:
                self._batch = batch
                new = self._choose(batch, why, stats.num_target_forwards).tree
                self._stale = not self.tree.drafts and new.drafts
                self.tree = new
            if self.captures:
                self.chooser.hold(self.kind, batch, self.tree)
        key = (batch, self.tree)  # the cycles each batch and tree ran, for the realized time (``finish``)
        self._ran[key] = self._ran.get(key, 0) + 1
        return self.tree

    def moved(self, generation) -> None:
        """The storage grew within the cycle (``Decoder.reserve``) to ``generation``: the graphs captured before went
        with the old memory, and the cycle's steps are captured on the new. Told after the growth, not at the next
        cycle: a cache that grew in a call's last cycle left the mirror holding the old memory's graphs, the next
        call's first look cleared them, and the call after it charged every tree a capture at a batch that held its
        graphs (an H100 matrix at greedy batch 4 and 16 then kept decoding without a tree)."""
        if self.captures:
            self.chooser.sync(generation)
            self.chooser.hold(self.kind, self._batch, self.tree)

    def finish(self, stats, setup: float, longest: int | None = None) -> None:
        """After the call's last cycle: observe it, and what the whole call took against what its first choice
        predicted for the ``longest`` row's tokens from cycles (at the acceptance the call got)."""
        self._observe(stats, setup)
        if self._plan is None or longest is None or self._setup0 is None:
            return
        batch, drafts, _ = self._plan
        if stats.num_target_forwards < _REALIZED_MIN_CYCLES or longest < 1:
            return
        # A call that drafted from the start and went on without a tree once rows finished still waited for its
        # slowest rows (this project's CPU at greedy batch 4: 93 cycles at 2.3 tokens for 128, not counted, and the
        # next calls drafted at the straggling of 1 and lost to generate)
        if drafts and stats.mean_accept_length > 1.0:
            slow = stats.num_target_forwards * stats.mean_accept_length / longest
            _note(self.chooser.straggle, (self.kind, batch, self.setting), min(max(slow, 1.0), 4.0))
        key = (self.kind, batch, self.setting, drafts)
        first, self.chooser.called = key not in self.chooser.called, self.chooser.called | {key}
        # A first call of a shape on a GPU pays first-use costs beyond its captures (a tree's first call took 7x its
        # prediction on the H200, 0.3 s beyond them), the next does not. An eager call has none to speak of: its
        # first call counts, so that the next call weighs a tree that lost (this project's CPU, greedy batch 4: two
        # calls drafted at 0.78x generate's rate, the first uncounted, dev/results/matrix_cpu_2026-12-06.json).
        if (first and self.mode is not None) or stats.time_compile > 0:
            return
        seconds = stats.time_draft + stats.time_verify + stats.time_other
        seconds += self.prompt_seconds if drafts else 0.0
        # Each cycle as predicted for the batch and tree it ran (the cycles' count is the straggling's): priced all at
        # the first choice's, a call that went on at fewer rows and cheaper cycles (a CPU's) looked faster than
        # predicted, and the next calls drafted again where they had lost
        ran = self._ran or {(batch, self.choices[0].tree): 1}
        mean = sum(n * self.chooser.seconds(self.table, self.kind, b)(t) for (b, t), n in ran.items()) / sum(
            ran.values())
        predicted = stats.num_target_forwards * mean
        if seconds > 0 and predicted > 0:
            _note(self.chooser.realized, key, seconds / predicted)

    def _observe(self, stats, setup: float) -> None:
        forwards, seconds = stats.num_target_forwards, stats.time_draft + stats.time_verify + stats.time_other
        last_forwards, last_drafts, last_counts, last_seconds, last_setup = self._last
        counts = list(stats.accept_counts)
        self._last = (forwards, stats.num_drafts, counts, seconds, setup)
        if forwards != last_forwards + 1:  # nothing new (the first look), or not one cycle
            return
        drafts = stats.num_drafts - last_drafts
        self._cycles += 1
        if self._stale:  # drafted from a head that missed the cycles without a tree: not what the tree gets
            self._stale = False
        else:
            self.acceptance.observe(self.tree, drafts,
                                    [c - (last_counts[i] if i < len(last_counts) else 0) for i, c in enumerate(counts)])
        if setup == last_setup:  # a cycle that captured or compiled a step says nothing of the steady cost
            self._learn_overhead(seconds - last_seconds)
        elif self.captures and setup > last_setup:  # ... but says what a capture costs
            _note(self.chooser.captures, self.kind, setup - last_setup, 15)

    def _learn_overhead(self, cycle: float) -> None:
        """The host's share of a cycle: what recent cycles took beyond the probed steps (their median: a cycle that
        a busy machine delayed says nothing of the next)."""
        key = (self.kind, self._batch, self.tree.drafts)
        steps = self._steps.get((self._batch, self.tree))
        if steps is None:  # read from the table once per batch and tree: the host's work per cycle stays small
            steps = self._steps[(self._batch, self.tree)] = cycle_seconds(self.table, self._batch, self.tree)
        recent = _note(self.chooser.residuals, key, cycle - steps, 15)
        self.chooser.overhead[key] = max(0.0, statistics.median(recent))


def _note(recent: dict, key, value: float, keep: int = _REALIZED_CALLS) -> collections.deque:
    """Append ``value`` to ``recent[key]``, the last ``keep`` values seen there; returns them."""
    seen = recent.setdefault(key, collections.deque(maxlen=keep))
    seen.append(value)
    return seen


def few_row_linears(table: dict, batch: int, q: int) -> bool:
    """Whether a forward of ``q`` tokens per row at ``batch`` rows runs with ``skinny.py``'s few-row linears: as the
    probe measured faster at the nearest batch at or below (``CycleCosts.few_row_linears``); ``table``: {batch:
    CycleCosts} of the call's decoding kind (``Chooser.table``)."""
    sizes = sorted(table)
    return table[max((b for b in sizes if b <= batch), default=sizes[0])].few_row_linears(q)


def _envelope(trees) -> TreeConfig:
    """The smallest tree shape every one of ``trees`` fits in."""
    drafting = [t for t in trees if t.drafts]
    if not drafting:
        return TreeConfig.none()
    d, k = max(t.depth for t in drafting), max(t.top_k for t in drafting)
    n = max(t.total_tokens for t in drafting)
    return TreeConfig(d, k, d if k == 1 else n)
