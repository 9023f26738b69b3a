"""One call's draft trees: the first choice, the buffers' capacity, and the choice made again as the call goes.

A ``Session`` is one call of the default tree (``loop.py`` makes it): its first tree, the capacity its buffers are
sized for (every tree it may switch to: the same for every call of a batch, so that later calls reuse the buffers and
the graphs captured on them), and the choice made again when the batch shrinks (rows finish) or the fitted acceptance
moves the best tree clearly past the one running. What it learns goes to the decoder's ``Chooser`` (``chooser.py``).

Where the steps replay as CUDA graphs, a tree not yet captured at a batch costs its capture once (measured: the
seconds the cycles that captured took beyond the steps). As rows finish, a call goes on at a smaller batch only where
it holds the graphs there or where the fewer rows save more than a capture over the tokens left
(``Session.shrink_pays``; a small target's call, which shrank at every power of two and captured at each, now
mostly keeps its batch), and there it keeps its tree (a new choice at each smaller batch made each call's path of
trees differ from the last one's, so that timed calls captured again). A choice is charged the capture at its own
batch only: a later shrink pays for itself. A call's first choice weighs the capture against what the tree would
save on ``_AMORTIZE`` calls' tokens (the graphs serve the calls after it too), a switch within the call against its
own tokens left.

What the probe and the per-cycle share miss, each call measures. A batch's rows accept at different rates, so it
runs until its slowest row is done (code-tiny on an H100 at batch 64: 47 cycles for 128 tokens at 4.9 a cycle): a
call's cycles over the longest row's tokens at its mean acceptance, where its first tree drafted
(``Chooser.straggle``, counted, so a first call's too), divide a drafting tree's tokens per cycle at that batch. Its
decode time against what was predicted for the cycles it ran, each at the batch and tree it ran
(``Chooser.realized``, apart for calls with and without a tree), scales later predictions of that kind at that batch
and setting, so a tree that lost to the plain decode it was weighed against is measured losing, and dropped. The
first call of each kind, batch and setting in a process on a GPU, and any call that captured or compiled, is not
counted there: it pays first-use costs (Triton builds, allocator growth) that later calls do not. A plain decode is
priced from the probe and a borrowed host share until it has run: where no cycle without a tree has run at a batch
and kind, a drafting call decodes its last ``_MEASURE_TOKENS`` tokens per row without one, to measure it, unless a
tree promises ``_MEASURE_PLAIN_BELOW`` times its rate (under CUDA graphs: a first call at the batch, or where those
graphs are held); and where a first choice is no tree while the acceptance rests on few drafts, the best tree runs
again, once per batch and setting, if it is expected close (``_THIN_DRAFTS``): without a tree a call observes no
acceptance.
"""
from __future__ import annotations

import collections
import logging
import statistics
import time
from dataclasses import dataclass, field, replace

from ..config import TreeConfig
from .acceptance import Acceptance
from .chooser import Chooser, Finalist, TreeChoice, candidate_trees, setting_of
from .cost_cache import decode_kind

logger = logging.getLogger(__name__)

__all__ = ["Session", "few_row_linears"]

_SWITCH = 1.05  # within a call, a new tree must promise this much more than the running one
_REFIT_SECONDS = 0.5  # within a call, the choice is reviewed (acceptance fitted again) at most this often
_REFIT_CYCLES = 16  # ... and after this many cycles
_FINALISTS = 3
_AMORTIZE = 4  # a call's first choice counts a capture against this many calls' tokens: later calls replay it
_SAMPLED_BYTES = 1 << 30  # a sampled tree's proposals (batch x nodes x vocabulary, fp32) stay within this
_REALIZED_CALLS = 5  # the realized-time ratio is the median of the last calls' of its kind, batch and setting
_REALIZED_MIN_CYCLES = 4  # a call of fewer cycles says little of how a long one goes
# Where no cycle without a tree has run at a batch and kind yet, a call that drafts (of more than twice as many new
# tokens) decodes its last _MEASURE_TOKENS tokens per row without one, to measure that cycle's host share here, unless the best tree promises this many times
# its rate (an H100 matrix lost to HF's static generate at greedy batch 32 and 64 with trees, while the plain decode it
# never ran was priced at a tree's host share). The tokens at the end, as the head then drafts no more: cycles without
# a tree leave the head's cache behind. A whole call without a tree measured it before (2026-12-07): that call took
# 1.38x a drafting one on this project's CPU at greedy batch 1 (1.25 against 0.90 s), 1.6x on an H100 at sampled batch
# 1 (0.198 against 0.123 s), and the host CPU's matrix, two timed calls a row, ran greedy batch 1 at 1.01x HF eager.
_MEASURE_PLAIN_BELOW = 2.0
_MEASURE_TOKENS = 12
_MEASURING = "no tree for the last tokens, to measure it here"
# A call's first choice of no tree while the acceptance in its setting rests on fewer than this many drafts drafts the
# best tree again, when that is expected within _RETRY_WITHIN of no tree's rate: a call without a tree observes no
# acceptance, so a fit from a first call's few cycles that priced the trees out stayed for good (code-tiny, greedy
# batch 1 on this project's CPU: 17 cycles fitted (0.58, 0.3, 0.65), every later call decoded without a tree at
# 0.95x eager generate, where runs that went on drafting fitted (0.62, 0.5, 0.85) and ran 1.13x and more). Once per
# batch and setting: a retried tree that its call dropped for no tree was drafted again two calls later, and such calls
# lose (sampled batch 1 on this project's CPU: 1.47 and 1.62 s against 1.40 s without a tree, 0.94x HF eager). On a
# CPU at one row only: every retry above it lost (dev/results/matrix_cpu_2026-12-07g.json, sampled 4 and 16).
_THIN_DRAFTS = 128
_RETRY_WITHIN = 1.15
# On a CPU, once the acceptance is measured (_THIN_DRAFTS), a tree must finish the call's tokens this many times sooner
# than no tree: drafting's costs beyond its steps are priced from few cycles, and trees 3% ahead lost (the GPU host's
# CPU, greedy batch 32: 0.68x, dev/results/ab21_h100_2026-12-07). Not on a GPU, whose no-tree price is optimistic (trees
# 1.10x ahead ran 1.5x HF, ab22), nor on the prior (a call without a tree never learns it: the demo then never drafted).
_DRAFT_MARGIN = 1.10


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
    _last: tuple = (0, 0, (), (), 0.0, 0.0)  # stats at the last look: forwards, drafts, accept and first-choice
    # counts, seconds, setup
    _batch: int = 0
    _fit_at: float = 0.0
    _cycles: int = 0  # cycles observed since the choice was last reviewed within the call
    idle: bool = False  # the call started without a tree: the head has no entries, nothing can be drafted
    _stale: bool = False  # the cycle just observed drafted from a head left as it was by cycles without a tree
    captures: bool = False  # the steps replay as CUDA graphs: a tree new at a batch costs its capture
    remaining: int = 0  # new tokens per row the call has left to decode (at most)
    prompt_seconds: float = 0.0  # the head's pass over the prompt (the loop times it): a cost of drafting
    _plan: tuple | None = None  # the first choice: (batch, drafts, its cycle's seconds as the probe and host predict)
    _setup0: float | None = None  # the decoder's setup seconds at the first cycle
    _ran: collections.Counter = field(default_factory=collections.Counter)  # (batch, tree) -> the cycles that ran it
    measure: bool = False  # the call decodes its last _MEASURE_TOKENS tokens per row without a tree, to measure it
    _tail: bool = False  # ... and does so now: it goes on without a tree to its end
    # The next cycle follows a new batch or tree: it pays the move (rows dropped, the cache compacted, the choice), so
    # it teaches no host share (one such cycle priced no tree at 24 ms against 11 on this project's CPU at batch 2)
    _moving: bool = False

    @classmethod
    def start(cls, chooser: Chooser, *, model, head, cap, batch: int, gen, sampler, mode, max_depth: int,
              max_top_k: int, shrinks: bool, mrope: bool = False) -> "Session":
        """Measure what is missing (this batch, and 1 when rows may finish), choose, size the capacity. ``shrinks``:
        the call goes on with fewer rows as they finish (else it keeps its tree: compiled steps). ``mode``: how the
        call's steps run (``options.choose_mode``): the costs are probed as CUDA graphs where it captures them.
        ``max_depth``: the new tokens the call decodes (the first choice weighs captures against them)."""
        graphs = mode is not None and chooser.on_gpu
        chooser.measure(model, head, cap, sorted({batch, 1} if shrinks else {batch}), sampler, graphs, mrope)
        setting = setting_of(gen)
        acceptance = chooser.acceptance_for(setting)
        kind = decode_kind(sampler, graphs, chooser.device)
        trees = candidate_trees(min(max_depth, 8), max_top_k)
        if sampler is not None:  # a sampled tree keeps each node's proposal over the vocabulary: bound its memory
            most = _SAMPLED_BYTES // (4 * batch * sampler.vocab_size) - 1
            trees = [t for t in trees if t.total_tokens <= most]
        s = cls(chooser, acceptance, chooser.table(kind), kind, trees, mode, setting, sampler=sampler,
                captures=mode == "graphs" and chooser.on_gpu, remaining=max_depth)
        # Per decoding kind: a sampled call's steps are not a greedy call's (its draft and acceptance compile anew),
        # so keeping a greedy call's tree saved it nothing and drafted a tree chosen for greedy acceptance (this
        # project's CPU, sampled batch 1 with compile=True: 4/4/16 at 0.81x generate, where no tree is its choice).
        key = (batch, mode, kind)
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
        s.measure = shrinks and max_depth > 2 * _MEASURE_TOKENS and s._plain_unmeasured(batch, first)
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
        steps = self.chooser.step_seconds
        saved = steps(self.table, self.kind, batch)(self.tree) - steps(self.table, self.kind, rows)(self.tree)
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
        out = []
        for f in ranked:  # a few hundred: a copy only where a capture is charged
            c = charge(f.tree)
            out.append(f if c == f.capture_seconds else replace(f, capture_seconds=c))
        return out

    def _seconds_left(self, remaining: int, calls: int = 1):
        """Finalist (charged) -> the seconds ``calls`` calls of the ``remaining`` tokens per row would take with its
        tree, its captures included (once)."""
        return lambda f: calls * remaining * f.cycle_seconds / f.accept_length + f.capture_seconds

    def _choose(self, batch: int, why: str, cycle: int = 0) -> TreeChoice:
        """The tree that finishes the call's remaining tokens soonest at ``batch``, its capture included; the one the
        last call chose at this batch while it is within ``_SWITCH`` of it (another tree shape is another graph to
        capture, or to compile). ``why`` ``_MEASURING``: no tree, whatever the rates."""
        ranked = self._charged(batch, self.rank(batch))
        key = (batch, self.kind, self.setting)
        left = self._seconds_left(self.remaining, _AMORTIZE if why == "first" else 1)
        best = min(ranked, key=left)  # ties: the faster rate, then the smaller tree (``ranked``'s order)
        last = next((f for f in ranked if f.tree == self.chooser.last.get(key)), None)
        if last is not None and left(last) <= _SWITCH * left(best):
            best = last
        plain = next(f for f in ranked if not f.tree.drafts)  # no tree is always a candidate
        if (best.tree.drafts and not self.chooser.on_gpu and self.acceptance.observed >= _THIN_DRAFTS
                and left(plain) <= _DRAFT_MARGIN * left(best)):
            best = plain
        if why == _MEASURING:  # the tree the call chose stays the one the next call holds to
            best = plain
        elif (why == "first" and not best.tree.drafts and 0 < self.acceptance.observed < _THIN_DRAFTS
              and key not in self.chooser.retried and (batch == 1 or self.chooser.on_gpu)):
            tree = next((f for f in ranked if f.tree.drafts
                         and f.tokens_per_second * _RETRY_WITHIN >= best.tokens_per_second), None)
            if tree is not None:
                best, why = tree, "a tree again: its acceptance is thinly measured"
                self.chooser.retried.add(key)
        if why != _MEASURING:
            self.chooser.last[key] = best.tree
        shown = [best] + ranked[:_FINALISTS] + [f for f in ranked if not f.tree.drafts or f.tree == self.tree]
        choice = TreeChoice(best.tree, batch, why, tuple(dict.fromkeys(shown)), self.acceptance.fit(), cycle)
        self.choices.append(choice)
        logger.info("draft tree: %s", choice)
        return choice

    def _plain_unmeasured(self, batch: int, first: TreeChoice) -> bool:
        """Whether a call that starts with ``first`` decodes its last tokens without a tree, to measure it: where it
        drafts, no cycle without a tree has been watched at ``batch`` and kind, and its tree does not promise
        ``_MEASURE_PLAIN_BELOW`` times no tree's rate."""
        plain = next((f for f in first.finalists if not f.tree.drafts), None)
        best = next(f for f in first.finalists if f.tree == first.tree)
        # Only where the tail costs no capture of its own (``_charge``: eager steps, a batch where nothing is held yet,
        # so every step captures anyway, or the steps without a tree held there): else it would capture inside a call
        # that replays everything else (an H100, greedy batch 16: the second call measured, 0.74 s against 0.16-0.24
        # s, dev/results/ab20_h100_2026-12-07). A cycle without a tree then takes the drafting cycles' host share on
        # a GPU until measured (``Chooser.seconds``).
        return (best.tree.drafts and plain is not None and (self.kind, batch, False) not in self.chooser.overhead
                and best.tokens_per_second < _MEASURE_PLAIN_BELOW * plain.tokens_per_second
                and self._charge(batch)(TreeConfig.none()) == 0.0)

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
            self._moving = self._moving or 0 < self._batch != batch  # rows finished: the next cycle pays the move
            if batch != self._batch and (self.captures or self._tail):  # the call keeps its tree, whose captures
                self._batch = batch  # its choice counted (or, measuring, no tree)
            elif batch != self._batch:
                why = "rows finished"
            elif self.measure and self.tree.drafts and self.remaining <= _MEASURE_TOKENS:
                self.measure, self._tail, why = False, True, _MEASURING
            elif not self._tail and self._cycles >= _REFIT_CYCLES and now - self._fit_at >= _REFIT_SECONDS:
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
                self._moving = self._moving or new != self.tree
                self.tree = new
            if self.captures:
                self.chooser.hold(self.kind, batch, self.tree)
        self._ran[(batch, self.tree)] += 1  # the cycles each batch and tree ran, for the realized time (``finish``)
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
        last_forwards, last_drafts, last_counts, last_firsts, last_seconds, last_setup = self._last
        counts, firsts = list(stats.accept_counts), list(stats.first_counts)
        self._last = (forwards, stats.num_drafts, counts, firsts, seconds, setup)
        if forwards != last_forwards + 1:  # nothing new (the first look), or not one cycle
            return
        drafts = stats.num_drafts - last_drafts
        self._cycles += 1
        if self._stale:  # drafted from a head that missed the cycles without a tree: not what the tree gets
            self._stale = False
        elif self.tree.drafts:  # the counts gained since the last look (shorter then when the tree was shallower)
            self.acceptance.observe(self.tree, drafts,
                                    [c - (last_counts[i] if i < len(last_counts) else 0) for i, c in enumerate(counts)],
                                    [c - (last_firsts[i] if i < len(last_firsts) else 0) for i, c in enumerate(firsts)])
        moving, self._moving = self._moving, False
        if setup == last_setup and not moving:  # a cycle that captured or compiled a step, or moved to a new batch or
            self._learn_overhead(seconds - last_seconds)  # tree, says nothing of the steady cost
        elif self.captures and setup > last_setup:  # ... but says what a capture costs
            _note(self.chooser.captures, self.kind, setup - last_setup, 15)

    def _learn_overhead(self, cycle: float) -> None:
        """The host's share of a cycle: what recent cycles took beyond the probed steps (their median: a cycle that
        a busy machine delayed says nothing of the next)."""
        key = (self.kind, self._batch, self.tree.drafts)
        steps = self.chooser.step_seconds(self.table, self.kind, self._batch)(self.tree)
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
