"""How many tokens a draft tree commits per cycle, for any tree shape, from three numbers about the head.

The model, per model, head and decoding setting:
  a  the chance that the head's first choice at the root is the target's next token;
  c  the same chance at a deeper node, given that the path to it was accepted: a head that got the first token right
     has the target's features right and is right more often after it (code-tiny's chain of 8, greedy on a CPU:
     0.64 at the first position, then 0.78-0.97 for each next one given the last; two numbers with c = a
     underestimated its deep trees by up to a third, and the chooser drafted shallower trees than a fixed table);
  t  of what the first choice misses, the share each further choice catches: the head's r-th choice is the
     target's token with chance p(r) = (1 - f) * t * (1 - t)**(r - 2) for r >= 2 (p(1) = f, f = a or c).
A node is accepted with the product of p(rank) along its path. EAGLE-2's dynamic tree keeps the nodes the head is
most confident in; with that confidence replaced by these averages, the tree of (depth, top_k, total_tokens) is
built by the same rule (``draft.draft_candidates``, ``tree.select_tree``): a frontier of the top_k best nodes per
level, top_k children each, and the total_tokens best nodes of all levels kept. At most one node per depth is
accepted, so P(accepted length >= i) is the sum of the kept nodes' chances at depth i, and the expected tokens per
cycle is 1 (the target's own token) plus the sum over all kept nodes. A chain of depth d commits
1 + a + a c + ... + a c**(d - 1).

``Acceptance`` fits (a, t, c) to what decoding observes, per tree shape run: drafts and per-position acceptance
counts (what ``SpeculativeStats.accept_counts`` holds) and, for trees, how many accepted paths were the head's first
choices from the root on (``first_counts``: a path of first choices is accepted to depth i with chance a c**(i-1)),
by least squares over a grid, weighted by drafts, with a weak prior. Without the first choices one tree's counts do
not tell a from t (a head right more often at its first choice, or at its others): a single unlucky call of a
sampled 3/6/24 tree on an H100 fitted t = 0, after which the chooser drafted chains, which never measure t, and lost
to the fixed tree it replaced (dev/results/ab16_h100_2026-12-07/ab). Older observations fade, so the estimate
follows a drift. The replay of ``autotree.calibrate`` feeds it the same way (counts only). Everything here is a pure
function of the numbers given, except ``Acceptance``, which keeps its observations.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ..config import TreeConfig

__all__ = ["rank_chances", "position_rates", "expected_lengths", "Acceptance", "PRIOR"]

# (a, t, c) before anything is observed: a head that is often right, as trained heads are, and more often below the
# root (the chain data above); the fit leaves it as soon as a tree's counts say otherwise.
PRIOR = (0.6, 0.3, 0.8)
_PRIOR_DRAFTS = 8.0  # the prior weighs as much as this many drafts
_WINDOW = 4096.0  # drafts over which an observation fades to 1/e: the estimate follows a drift
_A = torch.linspace(0.02, 0.98, 49, dtype=torch.float64)
_T = torch.linspace(0.0, 0.9, 10, dtype=torch.float64)
_C = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
GRID = torch.cartesian_prod(_A, _T, _C)  # (G, 3): every (a, t, c) the fit considers


def rank_chances(a, t, k: int):
    """p(1..k): the chance that the head's r-th choice is the target's token, its first choice right with chance
    ``a`` (the root's a, or a deeper node's c). a, t: floats or (G,) tensors."""
    if isinstance(a, torch.Tensor):
        r = torch.arange(2, k + 1, dtype=a.dtype)
        rest = (1 - a)[:, None] * t[:, None] * (1 - t)[:, None] ** (r - 2)
        return torch.cat((a[:, None], rest), 1)  # (G, k)
    return [a] + [(1 - a) * t * (1 - t) ** (r - 2) for r in range(2, k + 1)]


def _levels(a: float, t: float, c: float, k: int, depth: int) -> list[list[float]]:
    """The chances of every candidate, per level (creation order does not matter for sums): level 1 holds the
    root's k children, each further level the k children of the k best nodes of the level before."""
    first, deeper = rank_chances(a, t, k), rank_chances(c, t, k)
    levels, front = [first], first
    for _ in range(1, depth):
        children = [v * q for v in front for q in deeper]
        levels.append(children)
        front = heapq.nlargest(k, children)
    return levels


def position_rates(a: float, t: float, tree: TreeConfig, c: float | None = None) -> list[float]:
    """[i]: P(accepted length >= i + 1) for ``tree`` under (a, t, c); c = a when not given."""
    if not tree.drafts:
        return []
    levels = _levels(a, t, a if c is None else c, tree.top_k, tree.depth)
    kept = heapq.nlargest(tree.total_tokens, ((v, d) for d, level in enumerate(levels) for v in level))
    rates = [0.0] * tree.depth
    for v, d in kept:
        rates[d] += v
    return rates


def expected_lengths(a: float, t: float, trees, c: float | None = None) -> dict[TreeConfig, float]:
    """Expected tokens per cycle (the target's own included) of each tree under (a, t, c), c = a when not given;
    one pass per top_k, so a grid of trees costs little more than its widest member."""
    c = a if c is None else c
    out, by_k = {}, {}
    for tree in trees:
        if not tree.drafts:
            out[tree] = 1.0
        else:
            by_k.setdefault(tree.top_k, []).append(tree)
    for k, group in by_k.items():
        depth, most = max(t_.depth for t_ in group), max(t_.total_tokens for t_ in group)
        levels = _levels(a, t, c, k, depth)
        best: list[float] = []  # the `most` largest chances of levels 1..d, largest first
        sums = {}
        for d, level in enumerate(levels, start=1):
            best = heapq.nlargest(most, best + level)
            run, acc = [0.0], 0.0
            for v in best:
                acc += v
                run.append(acc)
            sums[d] = run
        for tree in group:
            run = sums[tree.depth]
            out[tree] = 1.0 + run[min(tree.total_tokens, len(run) - 1)]
    return out


def _grid_rates(tree: TreeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, depth) twice, at every (a, t, c) of ``GRID`` at once: ``position_rates``, and the chance that the path of
    first choices is accepted to depth i + 1 (0 from the depth where the tree does not keep it)."""
    k, G = tree.top_k, GRID.shape[0]
    first = rank_chances(GRID[:, 0], GRID[:, 1], k).float()  # (G, k)
    deeper = rank_chances(GRID[:, 2], GRID[:, 1], k).float()  # (G, k)
    values, depths, front = [first], [torch.zeros(k, dtype=torch.long)], first
    rows = torch.arange(G)
    # Where the first choices' path sits: its node's index among all candidates, and its place in the frontier
    # (-1 once the frontier drops it); level d's candidates are the frontier's k children each, in frontier order.
    at, place, start = [torch.zeros(G, dtype=torch.long)], torch.zeros(G, dtype=torch.long), k
    for d in range(1, tree.depth):
        children = (front[:, :, None] * deeper[:, None, :]).reshape(G, k * k)
        values.append(children)
        depths.append(torch.full((k * k,), d, dtype=torch.long))
        at.append(torch.where(place >= 0, start + place * k, -1))
        top = children.topk(k, dim=1)
        front = top.values
        hit = top.indices == (place * k)[:, None]  # (G, k)
        place = torch.where((place >= 0) & hit.any(1), hit.long().argmax(1), -1)
        start += k * k
    values, depths = torch.cat(values, 1), torch.cat(depths)
    top = values.topk(tree.total_tokens, dim=1)
    rates = torch.zeros(G, tree.depth, dtype=torch.float64)
    rates.scatter_add_(1, depths[top.indices], top.values.double())
    kept = torch.zeros(G, values.shape[1] + 1, dtype=torch.bool)  # a last column for "not in the frontier"
    kept[rows[:, None], top.indices] = True
    at = torch.stack(at, 1)  # (G, depth)
    path = kept.gather(1, torch.where(at >= 0, at, values.shape[1])).long().cumprod(1)
    chain = GRID[:, :1] * GRID[:, 2:3] ** torch.arange(tree.depth, dtype=torch.float64)  # a c**i
    return rates, chain * path


@dataclass
class Acceptance:
    """The running estimate of (a, t, c) for one model, head and setting, from the trees decoding ran."""

    prior: tuple[float, float, float] = PRIOR
    drafts: dict = field(default_factory=dict)  # TreeConfig -> drafts observed (faded)
    counts: dict = field(default_factory=dict)  # TreeConfig -> [drafts whose accepted length >= i + 1] (faded)
    # TreeConfig (trees, not chains) -> (drafts observed with their first choices, [of them, those whose accepted
    # nodes to depth i + 1 were all first choices]) (faded)
    firsts: dict = field(default_factory=dict)
    fitted: tuple[float, float, float] | None = None
    _tables: dict = field(default_factory=dict, repr=False)  # TreeConfig -> _grid_rates(tree)
    _lengths: dict = field(default_factory=dict, repr=False)  # (a, t, c) of the grid -> {TreeConfig: length}

    def __post_init__(self):
        if len(self.prior) != 3 or not all(0.0 <= v <= 1.0 for v in self.prior):
            raise ValueError(f"prior must be (a, t, c), each in [0, 1], got {self.prior!r}")

    def observe(self, tree: TreeConfig, drafts: int, counts: list, firsts: list | None = None) -> None:
        """Add ``drafts`` (row, cycle) drafts of ``tree``, how many of them accepted >= i + 1 tokens and, where known,
        how many of those were first choices all the way (``SpeculativeStats.first_counts``)."""
        if not tree.drafts or drafts <= 0:
            return
        if len(counts) < tree.depth or any(c < 0 or c > drafts for c in counts[: tree.depth]):
            raise ValueError(f"counts {counts!r} are not acceptance counts of {drafts} drafts of {tree}")
        if firsts is not None and (len(firsts) < tree.depth or any(
                f < 0 or f > c for f, c in zip(firsts[: tree.depth], counts[: tree.depth]))):
            raise ValueError(f"first-choice counts {firsts!r} do not fit the acceptance counts {counts!r} of {tree}")
        fade = (1.0 - 1.0 / _WINDOW) ** drafts
        for key in self.drafts:
            self.drafts[key] *= fade
            self.counts[key] = [c * fade for c in self.counts[key]]
            if key in self.firsts:
                n, seen = self.firsts[key]
                self.firsts[key] = (n * fade, [c * fade for c in seen])
        self.drafts[tree] = self.drafts.get(tree, 0.0) + drafts
        old = self.counts.get(tree, [0.0] * tree.depth)
        self.counts[tree] = [o + c for o, c in zip(old, counts[: tree.depth])]
        if firsts is not None and tree.top_k > 1:  # a chain's first choices are its counts: no second look
            n, old = self.firsts.get(tree, (0.0, [0.0] * tree.depth))
            self.firsts[tree] = (n + drafts, [o + c for o, c in zip(old, firsts[: tree.depth])])
        self.fitted = None

    @property
    def observed(self) -> float:
        """Drafts observed (faded)."""
        return sum(self.drafts.values())

    def fit(self) -> tuple[float, float, float]:
        """(a, t, c) minimising the drafts-weighted squared error of the per-position rates, plus the prior's pull."""
        if self.fitted is not None:
            return self.fitted
        a0, t0, c0 = self.prior
        loss = _PRIOR_DRAFTS * ((GRID[:, 0] - a0) ** 2 + 0.25 * (GRID[:, 1] - t0) ** 2 + (GRID[:, 2] - c0) ** 2)
        for tree, n in self.drafts.items():
            if tree not in self._tables:
                self._tables[tree] = _grid_rates(tree)
            rates, chain = self._tables[tree]
            seen = torch.tensor(self.counts[tree], dtype=torch.float64) / n
            loss = loss + n * ((rates - seen) ** 2).sum(1)
            if tree in self.firsts:
                m, firsts = self.firsts[tree]
                loss = loss + m * ((chain - torch.tensor(firsts, dtype=torch.float64) / m) ** 2).sum(1)
        best = GRID[int(loss.argmin())]
        self.fitted = (float(best[0]), float(best[1]), float(best[2]))
        return self.fitted

    def expected_lengths(self, trees) -> dict[TreeConfig, float]:
        """``expected_lengths`` at the fitted (a, t, c), kept per point of the grid: the fit moves among few of
        them, and a choice ranks a few hundred trees."""
        a, t, c = self.fit()
        known = self._lengths.setdefault((a, t, c), {})
        missing = [tr for tr in trees if tr not in known]
        if missing:
            known.update(expected_lengths(a, t, missing, c))
        return {tr: known[tr] for tr in trees}
