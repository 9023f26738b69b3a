"""``tree="auto"``: pick the draft tree's depth, top-k and size for this target, head and device.

A tree ``cfg`` gains E[L](cfg) tokens per decode cycle (accepted draft tokens + the bonus) and costs
T(cfg) seconds per cycle, so decoding runs at E[L] / T tokens per second; ``choose_tree`` maximises that
over a grid of trees.

T(cfg) = verify(N) + draft(k, D) + fixed, measured on this device (``measure_costs``):
  verify(N)  the target's side of a cycle with N draft nodes: tree mask, one forward of root + N nodes
             over a cached prefix, greedy verification, the host sync, keeping the path in the cache.
             Flat on a GPU until compute binds, steep on a CPU. Interpolated between measured sizes.
  draft(k,D) ``draft_tree`` at depth 1, plus (D - 1) further levels (one head forward on k nodes each).
  fixed      what else the loop spends per cycle (head update, commit and stopping checks, Python): the
             residual of a real ``speculative_generate`` run.
Timed jobs take turns round by round (a slow spell of a shared machine hits all sizes alike); medians.

E[L](cfg) is replayed, not modelled (``calibrate``). In greedy decoding the target's continuation of a
prompt decides every acceptance: a draft node is accepted iff its path spells the continuation. One greedy
run of the target per calibration prompt and one head pass give the head's state at every root position;
drafting there once per top_k at the largest depth yields every candidate with its score, and any smaller
(depth, total) keeps a prefix of those candidates (levels are created in order) reranked by ``select_tree``
exactly as ``draft_tree`` would. Walking the roots as the decode loop does (next root = root + accepted + 1)
visits exactly the cycles ``speculative_generate`` runs on these prompts, so the replayed E[L] is its
``mean_accept_length``. (Averaging over every root instead is biased: a cycle starts at the bonus token,
right after a rejection, so the loop's roots fall in step with the tokens the head gets wrong.)
For sampling the greedy replay is an approximation of the acceptance.

The prediction ranks the grid; the last word is a measurement (``runoff``): the best ``FINALISTS`` predicted trees
and the tree the default call would draft (``options.default_tree``) decode the calibration prompts end to end
through the real loop (``decode``: the engine, its graphs), and the fastest wins, the default on ties. Greedy
output does not depend on the tree, so every finalist does the same work. This keeps tree="auto" from being
slower than the default where the cost model (measured on the eager steps) misjudges the engine.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..target.parts import resolve_target
from ..target.compat import cache_kwarg, output_cache
from ..config import TreeConfig
from .draft import HeadCache, draft_candidates, head_cache, scratch_slots, with_scratch
from .options import default_tree
from ..target.features import FeatureCapture
from .tree import select_tree
from ..kernels.reference import greedy_accept
# The device-cost half of tree="auto" lives in autotree_costs; its public names stay importable from here.
from .autotree_costs import (SIZES, TOP_KS, TOTALS, DeviceCosts, _timings, measure_costs, measure_draft_cost,
                             measure_loop_overhead, measure_verify_cost)

logger = logging.getLogger(__name__)

__all__ = ["DeviceCosts", "Replay", "TreeEstimate", "AutoTreeResult", "measure_verify_cost", "measure_draft_cost",
           "measure_loop_overhead", "measure_costs", "calibrate", "default_grid", "rank_trees", "runoff", "choose_tree"]

FINALISTS = 3  # the best predicted trees that the runoff times end to end against the default call's tree
_TIE = 1.02  # a finalist must beat the default's time by more than 2% to replace it



# ---- acceptance replay ----------------------------------------------------------------------------
@dataclass
class _Candidates:
    tokens: torch.Tensor  # (R, M) target ids, creation order: k at depth 1, then k*k per further level
    parent: torch.Tensor  # (R, M) candidate index of the parent, -1 = the root
    depth: torch.Tensor  # (M,)
    score: torch.Tensor  # (R, M) cumulative draft log-prob, what select_tree ranks by


def _draft_candidates(head, cache: HeadCache, root_out, root_logits, root_pos, top_k: int, depth: int) -> _Candidates:
    """``draft_tree``'s greedy candidates before its global rerank (on the host), so that one draft serves
    every total and every smaller depth."""
    c = draft_candidates(head, with_scratch(cache, scratch_slots(top_k, depth)), root_out, root_logits, root_pos,
                         top_k, depth)
    return _Candidates(c.tokens.cpu(), c.parent.cpu(), c.depth.cpu(), c.score.cpu())


@dataclass
class Replay:
    """Every root position the decode loop can visit on the calibration prompts (rows, prompt after prompt):
    the target's greedy continuation after it and the head's draft candidates there, per top_k."""

    root: torch.Tensor  # (R,) root token of each row
    ahead: torch.Tensor  # (R, D+1) [r, d]: the target's greedy token after row r's right node at depth d
    candidates: dict[int, _Candidates]
    spans: list[tuple[int, int, int]]  # per prompt: (first row, prompt length, max_new_tokens)
    max_depth: int

    def accept_lengths(self, tree: TreeConfig) -> torch.Tensor:
        """(R,) draft tokens greedy verification accepts at each row's root with this tree."""
        if tree.top_k not in self.candidates or tree.depth > self.max_depth:
            raise ValueError(f"{tree} was not calibrated: top_k in {sorted(self.candidates)}, "
                             f"depth <= {self.max_depth}")
        c, k = self.candidates[tree.top_k], tree.top_k
        m = k + (tree.depth - 1) * k * k  # the candidates of levels 1..depth
        drafted = select_tree(self.root, c.tokens[:, :m], c.parent[:, :m], c.depth[:m], c.score[:, :m],
                              tree.total_tokens)
        target = self.ahead.gather(1, drafted.depth)  # (R, N+1); only nodes on the right path matter
        return greedy_accept(drafted.tokens, drafted.parent, drafted.depth, target, tree.depth)[0]

    def mean_accept_length(self, tree: TreeConfig) -> float:
        """Tokens per cycle (bonus included) over the cycles ``speculative_generate`` runs on each prompt."""
        acc = self.accept_lengths(tree).tolist()
        tokens = cycles = 0
        for first, _, max_new in self.spans:
            done, p = 1, 0  # the prefill commits the first token
            while done < max_new:
                gained = acc[first + p] + 1
                tokens, cycles, done, p = tokens + gained, cycles + 1, done + gained, p + gained
        return tokens / cycles


def _prompt_rows(prompts, device) -> list[torch.Tensor]:
    """A (B, L) tensor or a list of (L,)/(1, L) tensors -> list of (1, L) long tensors on ``device``."""
    rows = list(prompts) if not isinstance(prompts, torch.Tensor) else list(prompts.view(-1, prompts.shape[-1]))
    rows = [torch.as_tensor(r).reshape(1, -1).long().to(device) for r in rows]
    if not rows or any(r.shape[1] == 0 for r in rows):
        raise ValueError("calibration needs at least one non-empty prompt")
    return rows


def _greedy_run(model, cap: FeatureCapture, ids: torch.Tensor, n: int):
    """The target's greedy continuation: (1, L+n) tokens and the captured features of the first L+n-1."""
    L, dev = ids.shape[1], ids.device
    out = model(input_ids=ids, position_ids=torch.arange(L, device=dev)[None], use_cache=True)
    feats, seq = [cap.features()], [ids]
    for i in range(n):
        tok = out.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        seq.append(tok)
        if i < n - 1:
            out = model(input_ids=tok, position_ids=torch.full_like(tok, L + i), use_cache=True,
                        **{cache_kwarg(model): output_cache(out)})
            feats.append(cap.features())
    return torch.cat(seq, 1), torch.cat(feats, 1)


@torch.no_grad()
def calibrate(model, head, prompts, *, top_ks=TOP_KS, max_depth: int = 8, max_new_tokens: int = 48,
              rows_per_batch: int = 64) -> Replay:
    """Run the target greedily for ``max_new_tokens`` (+ ``max_depth``) tokens after each prompt and draft at
    every root position the decode loop can reach, once per top_k at ``max_depth`` levels."""
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 (the first token needs no draft), got {max_new_tokens}")
    parts = resolve_target(model)
    head.attach(model)
    vd = getattr(head.config, "draft_vocab_size", None) or head.config.vocab_size
    if max(top_ks) > vd:
        raise ValueError(f"top_k={max(top_ks)} exceeds the head's draft vocabulary of {vd} tokens")
    rows = _prompt_rows(prompts, next(model.parameters()).device)
    with FeatureCapture(parts, head.feature_layers(parts.num_layers)) as cap:
        runs = [_greedy_run(model, cap, ids, max_new_tokens + max_depth) for ids in rows]
    roots, aheads, spans, cands = [], [], [], {k: [] for k in top_ks}
    for ids, (seq, feats) in zip(rows, runs):
        T, dev = seq.shape[1], seq.device
        hcache, h_out, h_logits = head_cache(head, feats, seq[:, 1:], torch.arange(T - 1, device=dev)[None])
        at = torch.arange(ids.shape[1], ids.shape[1] + max_new_tokens - 1, device=dev)  # reachable roots
        spans.append((sum(r.numel() for r in roots), ids.shape[1], max_new_tokens))
        roots.append(seq[0, at].cpu())
        aheads.append(seq[0, at[:, None] + torch.arange(1, max_depth + 2, device=dev)].cpu())
        for q in at.split(rows_per_batch):
            R, S = q.numel(), int(q[-1])  # entries 0..q-1 exist when the root is at position q
            ent = torch.arange(S, device=dev)[None]
            cache = HeadCache(hcache.k[:, :, :S].expand(R, -1, -1, -1), hcache.v[:, :, :S].expand(R, -1, -1, -1),
                              torch.where(ent < q[:, None], ent, -1))
            for k in top_ks:
                cands[k].append(_draft_candidates(head, cache, h_out[0, q - 1], h_logits[0, q - 1], q, k, max_depth))
    joined = {k: _Candidates(torch.cat([c.tokens for c in cs]), torch.cat([c.parent for c in cs]), cs[0].depth,
                             torch.cat([c.score for c in cs])) for k, cs in cands.items()}
    return Replay(torch.cat(roots), torch.cat(aheads), joined, spans, max_depth)


# ---- the choice -----------------------------------------------------------------------------------
def default_grid(*, max_depth: int = 8, top_ks=TOP_KS, totals=TOTALS) -> list[TreeConfig]:
    """Chains of depth 1..max_depth, and trees of every top_k > 1, depth and total that can be drafted."""
    grid = []
    for k in top_ks:
        for d in range(1, max_depth + 1):
            most = k + (d - 1) * k * k
            grid += [TreeConfig.chain(d)] if k == 1 else [TreeConfig(d, k, n) for n in totals if n <= most]
    return grid


@dataclass(frozen=True)
class TreeEstimate:
    tree: TreeConfig
    accept_length: float  # E[L]: tokens per cycle, bonus included
    cycle_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.accept_length / self.cycle_seconds if self.cycle_seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"depth": self.tree.depth, "top_k": self.tree.top_k, "total_tokens": self.tree.total_tokens,
                "accept_length": self.accept_length, "cycle_seconds": self.cycle_seconds,
                "tokens_per_second": self.tokens_per_second}


@dataclass
class AutoTreeResult:
    """The chosen tree, every candidate's prediction (best first), and the default call's tree's."""

    chosen: TreeEstimate
    default: TreeEstimate | None  # None when the calibration did not cover the default tree
    candidates: list[TreeEstimate]
    costs: DeviceCosts
    calibration_seconds: float = 0.0
    measured: dict = field(default_factory=dict)  # the runoff: TreeConfig -> median seconds to decode the prompts

    @property
    def tree(self) -> TreeConfig:
        return self.chosen.tree

    @property
    def predicted_tokens_per_second(self) -> float:
        return self.chosen.tokens_per_second

    def table(self, rows: int = 10) -> str:
        lines = ["| depth | top_k | total | E[L] | ms/cycle | tok/s |", "|---|---|---|---|---|---|"]
        shown = self.candidates[:rows]
        if self.default is not None and self.default not in shown:
            shown = shown + [self.default]
        for e in shown:
            mark = " (default)" if self.default is not None and e.tree == self.default.tree else ""
            lines.append(f"| {e.tree.depth} | {e.tree.top_k} | {e.tree.total_tokens}{mark} | {e.accept_length:.2f} "
                         f"| {1e3 * e.cycle_seconds:.2f} | {e.tokens_per_second:.1f} |")
        return "\n".join(lines)

    def as_dict(self, candidates: bool = True) -> dict:
        d = {"chosen": self.chosen.as_dict(), "default": self.default.as_dict() if self.default else None,
             "costs": self.costs.as_dict(), "calibration_seconds": self.calibration_seconds,
             "measured": [{"depth": t.depth, "top_k": t.top_k, "total_tokens": t.total_tokens, "seconds": sec}
                          for t, sec in self.measured.items()]}
        return {**d, "candidates": [e.as_dict() for e in self.candidates]} if candidates else d


def rank_trees(replay: Replay, costs: DeviceCosts, grid, *,
               default: TreeConfig | None = TreeConfig()) -> AutoTreeResult:
    """Predict tokens/s for every tree of ``grid``; best first, ties to the smaller tree."""
    def estimate(t: TreeConfig) -> TreeEstimate:
        return TreeEstimate(t, replay.mean_accept_length(t), costs.cycle_seconds(t))

    grid = list(dict.fromkeys(grid))
    if not grid:
        raise ValueError("the grid of trees to choose from is empty")
    ranked = sorted((estimate(t) for t in grid),
                    key=lambda e: (-e.tokens_per_second, e.tree.total_tokens, e.tree.depth, e.tree.top_k))
    known = default is not None and default.top_k in replay.candidates and default.depth <= replay.max_depth
    return AutoTreeResult(ranked[0], estimate(default) if known else None, ranked, costs)


def choose_tree(model, head, calib_input_ids, *, device_costs: DeviceCosts | None = None, grid=None,
                max_new_tokens: int = 48, batch_size: int = 1, repeats: int = 5, decode=None) -> AutoTreeResult:
    """Pick the TreeConfig with the most predicted tokens/s for ``model`` + ``head`` on this device.

    calib_input_ids: (B, L) prompts (no padding) or a list of 1-D prompts; each is continued greedily for
    ``max_new_tokens`` tokens. device_costs: measured here (``measure_costs``) when None. grid: the trees
    to choose from (``default_grid()`` when None). ``batch_size`` is the batch the costs are measured for.
    ``decode``: the loop timed for its overhead and in the ``runoff``, ``eagle_mm.speculative_generate`` (needed
    when costs are measured; without it the prediction alone decides).
    """
    start = time.perf_counter()
    vd = getattr(head.config, "draft_vocab_size", None) or head.config.vocab_size
    if grid is None:
        grid = [t for t in default_grid() if t.top_k <= vd]
    grid = list(grid)
    bad = [t for t in grid if not isinstance(t, TreeConfig) or t.top_k > vd]
    if bad or not grid:
        raise ValueError(f"grid must be non-empty TreeConfigs with top_k <= {vd} (the draft vocabulary); "
                         f"bad: {bad[:3]}")
    dev = next(model.parameters()).device
    default = default_tree(dev, batch_size)  # what the default call drafts here
    covered = grid + ([default] if default.top_k <= vd else [])
    top_ks, max_depth = sorted({t.top_k for t in covered}), max(t.depth for t in covered)
    replay = calibrate(model, head, calib_input_ids, top_ks=top_ks, max_depth=max_depth, max_new_tokens=max_new_tokens)
    if device_costs is None:
        prefix = sum(n for _, n, _ in replay.spans) // len(replay.spans) + max_new_tokens // 2  # mid-generation
        sizes = sorted(set(SIZES) | {max(t.total_tokens for t in covered)})
        if decode is None:
            raise ValueError("choose_tree measures the decode loop's overhead: pass decode=eagle_mm.speculative_generate "
                             "(or device_costs=...)")
        device_costs = measure_costs(model, head, decode, sizes=sizes, top_ks=top_ks, depth=max(max_depth, 2),
                                     prefix_len=prefix, batch_size=batch_size, repeats=repeats)
    result = rank_trees(replay, device_costs, grid, default=default)
    if decode is not None:
        result = runoff(result, model, head, calib_input_ids, decode, default, max_new_tokens=max_new_tokens,
                        batch_size=batch_size, repeats=max(1, min(repeats, 3)))
    result.calibration_seconds = time.perf_counter() - start
    d = result.default
    logger.info("tree='auto' chose %s: E[L]=%.2f, %.1f tok/s predicted (default %s: %s); calibration %.1fs",
                result.tree, result.chosen.accept_length, result.predicted_tokens_per_second, default,
                f"E[L]={d.accept_length:.2f}, {d.tokens_per_second:.1f} tok/s" if d else "not evaluated",
                result.calibration_seconds)
    return result


def runoff(result: AutoTreeResult, model, head, prompts, decode, default: TreeConfig, *, max_new_tokens: int = 48,
           batch_size: int = 1, repeats: int = 3) -> AutoTreeResult:
    """The predicted best ``FINALISTS`` trees and ``default`` decode ``prompts`` greedily through ``decode``, in
    turns (one untimed round first: it captures each tree's graphs); the smallest median time wins, ``default``
    unless a finalist beats it by more than 2%. Returns ``result`` with ``chosen`` and ``measured`` set."""
    finalists = list(dict.fromkeys([e.tree for e in result.candidates[:FINALISTS]] + [default]))
    rows = [r.expand(batch_size, -1).contiguous() for r in _prompt_rows(prompts, next(model.parameters()).device)]

    def run(tree):
        for ids in rows:
            decode(model, head, input_ids=ids, max_new_tokens=max_new_tokens, tree=tree, do_sample=False)

    jobs = {t: (run, lambda t=t: t) for t in finalists}
    measured = {t: statistics.median(ts) for t, ts in
                _timings(jobs, repeats=repeats, warmup=1, device=rows[0].device).items()}
    best = min(measured, key=measured.get)
    if measured[default] <= _TIE * measured[best]:
        best = default
    estimates = {e.tree: e for e in result.candidates}
    if result.default is not None:
        estimates.setdefault(default, result.default)
    chosen = estimates.get(best) or TreeEstimate(best, float("nan"), float("nan"))
    logger.info("tree='auto' runoff (seconds to decode the calibration prompts): %s; chose %s",
                {str(t): round(sec, 4) for t, sec in measured.items()}, best)
    return dataclasses.replace(result, chosen=chosen, measured=measured)
