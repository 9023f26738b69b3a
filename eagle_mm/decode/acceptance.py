"""How many tokens a draft tree commits per cycle, for any tree shape, from two numbers about the head.

The model, per model, head and decoding setting:
  a  the chance that the head's first choice at a node is the target's next token, given that the path to the
     node was accepted;
  t  of what the first choice misses, the share each further choice catches: the head's r-th choice is the
     target's token with chance p(r) = (1 - a) * t * (1 - t)**(r - 2) for r >= 2 (p(1) = a).
A node is accepted with the product of p(rank) along its path. EAGLE-2's dynamic tree keeps the nodes the head is
most confident in; with that confidence replaced by these averages, the tree of (depth, top_k, total_tokens) is
built by the same rule (``draft.draft_candidates``, ``tree.select_tree``): a frontier of the top_k best nodes per
level, top_k children each, and the total_tokens best nodes of all levels kept. At most one node per depth is
accepted, so P(accepted length >= i) is the sum of the kept nodes' chances at depth i, and the expected tokens per
cycle is 1 (the target's own token) plus the sum over all kept nodes. A chain of depth d commits 1 + a + ... + a**d.

``Acceptance`` fits (a, t) to what decoding observes, per tree shape run: drafts and per-position acceptance counts
(what ``SpeculativeStats.accept_counts`` holds), by least squares over a grid, weighted by drafts, with a weak prior.
Older observations fade, so the estimate follows a drift. The replay of ``autotree.calibrate`` feeds it the same
way. Everything here is a pure function of the numbers given, except ``Acceptance``, which keeps its observations.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ..config import TreeConfig

__all__ = ["rank_chances", "position_rates", "expected_lengths", "Acceptance", "PRIOR"]

PRIOR = (0.6, 0.3)  # (a, t) before anything is observed: a head that is often right, as trained heads are
_PRIOR_DRAFTS = 8.0  # the prior weighs as much as this many drafts
_WINDOW = 4096.0  # drafts over which an observation fades to 1/e: the estimate follows a drift
_A = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
_T = torch.linspace(0.0, 0.9, 19, dtype=torch.float64)
GRID = torch.cartesian_prod(_A, _T)  # (G, 2): every (a, t) the fit considers


def rank_chances(a, t, k: int):
    """p(1..k): the chance that the head's r-th choice is the target's token. a, t: floats or (G,) tensors."""
    if isinstance(a, torch.Tensor):
        r = torch.arange(2, k + 1, dtype=a.dtype)
        rest = (1 - a)[:, None] * t[:, None] * (1 - t)[:, None] ** (r - 2)
        return torch.cat((a[:, None], rest), 1)  # (G, k)
    return [a] + [(1 - a) * t * (1 - t) ** (r - 2) for r in range(2, k + 1)]


def _levels(p: list[float], k: int, depth: int) -> list[list[float]]:
    """The chances of every candidate, per level (creation order does not matter for sums): level 1 holds the
    root's k children, each further level the k children of the k best nodes of the level before."""
    levels, front = [list(p[:k])], list(p[:k])
    for _ in range(1, depth):
        children = [v * q for v in front for q in p[:k]]
        levels.append(children)
        front = heapq.nlargest(k, children)
    return levels


def position_rates(a: float, t: float, tree: TreeConfig) -> list[float]:
    """[i]: P(accepted length >= i + 1) for ``tree`` under (a, t)."""
    if not tree.drafts:
        return []
    levels = _levels(rank_chances(a, t, tree.top_k), tree.top_k, tree.depth)
    kept = heapq.nlargest(tree.total_tokens, ((v, d) for d, level in enumerate(levels) for v in level))
    rates = [0.0] * tree.depth
    for v, d in kept:
        rates[d] += v
    return rates


def expected_lengths(a: float, t: float, trees) -> dict[TreeConfig, float]:
    """Expected tokens per cycle (the target's own included) of each tree under (a, t); one pass per top_k, so a
    grid of trees costs little more than its widest member."""
    out, by_k = {}, {}
    for tree in trees:
        if not tree.drafts:
            out[tree] = 1.0
        else:
            by_k.setdefault(tree.top_k, []).append(tree)
    for k, group in by_k.items():
        depth, most = max(t_.depth for t_ in group), max(t_.total_tokens for t_ in group)
        levels = _levels(rank_chances(a, t, k), k, depth)
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


def _grid_rates(tree: TreeConfig) -> torch.Tensor:
    """(G, depth): ``position_rates`` at every (a, t) of ``GRID`` at once."""
    k, G = tree.top_k, GRID.shape[0]
    p = rank_chances(GRID[:, 0], GRID[:, 1], k)  # (G, k)
    values, depths, front = [p], [torch.zeros(k, dtype=torch.long)], p
    for d in range(1, tree.depth):
        children = (front[:, :, None] * p[:, None, :]).reshape(G, k * k)
        values.append(children)
        depths.append(torch.full((k * k,), d, dtype=torch.long))
        front = children.topk(k, dim=1).values
    values, depths = torch.cat(values, 1), torch.cat(depths)
    top = values.topk(tree.total_tokens, dim=1)
    rates = torch.zeros(G, tree.depth, dtype=values.dtype)
    return rates.scatter_add_(1, depths[top.indices], top.values)


@dataclass
class Acceptance:
    """The running estimate of (a, t) for one model, head and setting, from the trees decoding ran."""

    prior: tuple[float, float] = PRIOR
    drafts: dict = field(default_factory=dict)  # TreeConfig -> drafts observed (faded)
    counts: dict = field(default_factory=dict)  # TreeConfig -> [drafts whose accepted length >= i + 1] (faded)
    fitted: tuple[float, float] | None = None
    _tables: dict = field(default_factory=dict, repr=False)  # TreeConfig -> _grid_rates(tree)
    _lengths: dict = field(default_factory=dict, repr=False)  # (a, t) of the grid -> {TreeConfig: expected length}

    def observe(self, tree: TreeConfig, drafts: int, counts: list) -> None:
        """Add ``drafts`` (row, cycle) drafts of ``tree`` and how many of them accepted >= i + 1 tokens."""
        if not tree.drafts or drafts <= 0:
            return
        if len(counts) < tree.depth or any(c < 0 or c > drafts for c in counts[: tree.depth]):
            raise ValueError(f"counts {counts!r} are not acceptance counts of {drafts} drafts of {tree}")
        fade = (1.0 - 1.0 / _WINDOW) ** drafts
        for key in self.drafts:
            self.drafts[key] *= fade
            self.counts[key] = [c * fade for c in self.counts[key]]
        self.drafts[tree] = self.drafts.get(tree, 0.0) + drafts
        old = self.counts.get(tree, [0.0] * tree.depth)
        self.counts[tree] = [o + c for o, c in zip(old, counts[: tree.depth])]
        self.fitted = None

    @property
    def observed(self) -> float:
        """Drafts observed (faded)."""
        return sum(self.drafts.values())

    def fit(self) -> tuple[float, float]:
        """(a, t) minimising the drafts-weighted squared error of the per-position rates, plus the prior's pull."""
        if self.fitted is not None:
            return self.fitted
        a0, t0 = self.prior
        loss = _PRIOR_DRAFTS * ((GRID[:, 0] - a0) ** 2 + 0.25 * (GRID[:, 1] - t0) ** 2)
        for tree, n in self.drafts.items():
            if tree not in self._tables:
                self._tables[tree] = _grid_rates(tree)
            seen = torch.tensor(self.counts[tree], dtype=torch.float64) / n
            loss = loss + n * ((self._tables[tree] - seen) ** 2).sum(1)
        best = GRID[int(loss.argmin())]
        self.fitted = (float(best[0]), float(best[1]))
        return self.fitted

    def expected_lengths(self, trees) -> dict[TreeConfig, float]:
        """``expected_lengths`` at the fitted (a, t), kept per point of the grid: the fit moves among few of them,
        and a choice ranks a few hundred trees."""
        known = self._lengths.setdefault(self.fit(), {})
        missing = [t for t in trees if t not in known]
        if missing:
            known.update(expected_lengths(*self.fit(), missing))
        return {t: known[t] for t in trees}
