"""Device costs for ``tree="auto"``: seconds per decode cycle by part, measured on this device.

T(cfg) = verify(N) + draft(k, D) + fixed (see ``eagle_mm.decode.autotree``): ``measure_verify_cost`` times the
target's side of a cycle at several tree sizes, ``measure_draft_cost`` the head's levels per top_k, and
``measure_loop_overhead`` the rest of a real ``speculative_generate`` cycle; ``measure_costs`` runs all three.
Timed jobs take turns round by round (a slow spell of a shared machine hits all sizes alike); medians.
"""
from __future__ import annotations

import copy
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from ..target.parts import resolve_target
from .dynamic import CacheSnapshot, SlotBook, keep_path
from .masks import layer_kinds, tree_masks
from ..target.compat import cache_kwarg, output_cache
from ..config import TreeConfig
from .draft import draft_tree, head_cache
from .skinny import skinny_linears
from ..kernels import verify_greedy
from .tree import ancestors

logger = logging.getLogger(__name__)

__all__ = ["SIZES", "TOP_KS", "TOTALS", "DeviceCosts", "measure_verify_cost", "measure_draft_cost", "measure_loop_overhead",
           "measure_costs"]

SIZES = (0, 1, 2, 4, 8, 16, 32, 64)  # draft nodes N at which the verify cost is measured (0: plain decoding)
TOP_KS = (1, 2, 4, 6, 8, 10)
TOTALS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree sizes (draft nodes) of tree="auto"'s default grid


# ---- device costs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceCosts:
    """Seconds per decode cycle, by part, for one batch shape on one device."""

    verify: dict[int, float]  # draft nodes N -> target side of a cycle (see the module docstring)
    draft: dict[int, tuple[float, float]]  # top_k -> (draft_tree at depth 1, each further level)
    fixed: float = 0.0  # the loop's other work per cycle, whatever the tree

    def verify_seconds(self, n: int) -> float:
        """Piecewise-linear in n between measured sizes, extended linearly past the ends. A larger forward
        never costs less, so timing noise is smoothed out by reading the table's isotonic fit."""
        xs = sorted(self.verify)
        ys = _isotonic([self.verify[x] for x in xs])
        if len(xs) == 1:
            return ys[0]
        i = min(max(sum(x <= n for x in xs) - 1, 0), len(xs) - 2)
        return max(ys[i] + (ys[i + 1] - ys[i]) * (n - xs[i]) / (xs[i + 1] - xs[i]), 0.0)

    def draft_seconds(self, top_k: int, depth: int) -> float:
        if top_k not in self.draft:
            raise ValueError(f"no draft cost measured for top_k={top_k}; have {sorted(self.draft)}")
        first, level = self.draft[top_k]
        return first + (depth - 1) * level

    def cycle_seconds(self, tree: TreeConfig) -> float:
        return self.verify_seconds(tree.total_tokens) + self.draft_seconds(tree.top_k, tree.depth) + self.fixed

    def as_dict(self) -> dict:
        return {"verify": dict(self.verify), "draft": {k: list(v) for k, v in self.draft.items()}, "fixed": self.fixed}


def _isotonic(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


def _timings(jobs: dict, *, repeats: int, warmup: int, device: torch.device) -> dict[object, list[float]]:
    """key -> wall times of ``run(setup())`` for ``jobs`` {key: (run, setup)}, one per round; setup is not timed.

    The jobs take turns, one run each per round, so that a slow spell of a shared machine falls on all of
    them rather than on one job's every run."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = {key: [] for key in jobs}
    for i in range(warmup + repeats):
        for key, (run, setup) in jobs.items():
            arg = setup()
            sync()  # queued work of the setup must not be charged to the run
            t0 = time.perf_counter()
            run(arg)
            sync()
            if i >= warmup:
                times[key].append(time.perf_counter() - t0)
    return times


def _median_seconds(jobs: dict, **timing) -> dict[object, float]:
    return {key: statistics.median(t) for key, t in _timings(jobs, **timing).items()}


def _probe_tree(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents and depths (n+1,) of a tree of n nodes: a chain of up to 8 levels, the rest on level 1."""
    i = torch.arange(n + 1, device=device)
    parent = torch.where(i <= 8, (i - 1).clamp(min=0), torch.zeros_like(i))
    return parent, torch.where(i <= 8, i, torch.ones_like(i))


@torch.no_grad()
def measure_verify_cost(model, sizes=SIZES[1:], *, prefix_len: int = 256, batch_size: int = 1, repeats: int = 5,
                        warmup: int = 2) -> dict[int, float]:
    """Median seconds of the target's side of a cycle with n draft nodes, for each n in ``sizes``.

    Timed as the fallback loop runs it: the 4D tree masks (``tree_masks``), one forward of root + n nodes
    over a cache of ``prefix_len`` tokens, greedy verification with the host sync reading its result, and
    ``keep_path`` keeping three nodes. The cache is copied before each run (untimed).
    """
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes) or not sizes:
        raise ValueError(f"sizes must be non-negative ints (draft nodes), got {sizes!r}")
    parts, dev = resolve_target(model), next(model.parameters()).device
    B, gen = batch_size, torch.Generator().manual_seed(0)
    V = min(parts.vocab_size, 1000)  # low ids: clear of the image/special tokens most vocabularies keep high
    prefix = torch.randint(V, (B, prefix_len), generator=gen).to(dev)
    base = output_cache(model(input_ids=prefix, use_cache=True))
    kinds = layer_kinds(parts.text_config, len(base.layers), base.layers)
    book = SlotBook.after_prefill(base, torch.arange(prefix_len, device=dev).expand(B, -1))
    jobs = {}
    for n in sorted(set(sizes)):
        parent, depth = (t.expand(B, -1) for t in _probe_tree(n, dev))  # (B, n+1)
        tokens = torch.randint(V, (B, n + 1), generator=gen).to(dev)
        q_pos, D = prefix_len + depth, min(n, 8)
        keep = torch.arange(min(n, 2) + 1, device=dev).expand(B, -1)  # root + two chain nodes

        def setup(n=n):
            cache, slots = copy.deepcopy(base), copy.deepcopy(book)
            return cache, slots, CacheSnapshot(cache, n + 1)

        def run(state, tokens=tokens, parent=parent, depth=depth, q_pos=q_pos, D=D, keep=keep, n=n):
            cache, slots, snap = state
            masks = tree_masks(kinds, slots.by_window(), q_pos, ancestors(parent, D), model.dtype)
            out = model(input_ids=tokens, attention_mask=masks, position_ids=q_pos, **{cache_kwarg(model): cache},
                        use_cache=True)
            accept_len = verify_greedy(out.logits, tokens, parent, depth, D, with_path=True)[0]
            accept_len.cpu()  # the cycle's one host sync
            keep_path(cache, snap, slots, keep, q_pos.gather(1, keep), n + 1)

        jobs[n] = (run, setup)
    return _median_seconds(jobs, repeats=repeats, warmup=warmup, device=dev)


@torch.no_grad()
def measure_draft_cost(head, top_ks=TOP_KS, *, depth: int = 8, prefix_len: int = 256, batch_size: int = 1,
                       repeats: int = 5, warmup: int = 2) -> dict[int, tuple[float, float]]:
    """top_k -> (seconds of ``draft_tree`` at depth 1, seconds per further level), from depths 1 and ``depth``,
    over a head cache of ``prefix_len`` entries (random features)."""
    if depth < 2:
        raise ValueError(f"depth must be >= 2 to measure the cost of a level, got {depth}")
    parts, p, B = head.target_parts, next(head.parameters()), batch_size
    gen = torch.Generator().manual_seed(0)
    width = len(head.feature_layers(parts.num_layers)) * parts.hidden_size
    feats = torch.randn(B, prefix_len, width, generator=gen).to(p.device, p.dtype)
    tokens = torch.randint(min(parts.vocab_size, 1000), (B, prefix_len), generator=gen).to(p.device)
    pos = torch.arange(prefix_len, device=p.device).expand(B, -1)
    cache, out, logits = head_cache(head, feats, tokens, pos)
    jobs = {}
    for k in top_ks:
        for d in (1, depth):
            cfg = TreeConfig(depth=d, top_k=k, total_tokens=d if k == 1 else min(k + (d - 1) * k * k, max(TOTALS)))
            jobs[k, d] = (lambda _, cfg=cfg: draft_tree(head, cache, tokens[:, -1], out[:, -1], logits[:, -1],
                                                         pos[:, -1] + 1, cfg), lambda: None)
    t = _median_seconds(jobs, repeats=repeats, warmup=warmup, device=p.device)
    return {k: (t[k, 1], max(t[k, depth] - t[k, 1], 0.0) / (depth - 1)) for k in top_ks}


def measure_loop_overhead(model, head, partial: DeviceCosts, decode, *, prefix_len: int = 256, batch_size: int = 1,
                          repeats: int = 5, lengths: tuple[int, int] = (2, 18)) -> float:
    """Seconds per cycle the real decode loop spends beyond ``partial``'s verify(N) + draft(k, D): the head
    update, committing tokens against the stopping criteria, Python. The residual of ``speculative_generate``
    with a chain of one, differenced over two generation lengths so that the prefill cancels. ``decode``:
    ``speculative_generate`` (passed in: the loop imports this module)."""

    dev, tree = next(model.parameters()).device, TreeConfig.chain(1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(min(resolve_target(model).vocab_size, 1000), (batch_size, prefix_len), generator=gen).to(dev)
    cycles = {}  # greedy: every run of one length takes as many cycles

    def run(n):
        out = decode(model, head, input_ids=ids, max_new_tokens=n, tree=tree, do_sample=False,
                                   return_dict_in_generate=True)
        cycles[n] = out.stats.num_target_forwards

    walls = _timings({n: (run, lambda n=n: n) for n in lengths}, repeats=repeats, warmup=1, device=dev)
    short, long = lengths
    if cycles[long] <= cycles[short]:  # e.g. an end-of-sequence token stopped both runs early
        logger.warning("could not time the decode loop (%s cycles); its overhead is left out", cycles)
        return 0.0
    # Differences within a round: both runs met the same spell of the machine.
    extra = statistics.median(b - a for a, b in zip(walls[short], walls[long]))
    per_cycle = extra / (cycles[long] - cycles[short])
    return max(per_cycle - partial.cycle_seconds(tree), 0.0)


def measure_costs(model, head, decode, *, sizes=SIZES, top_ks=TOP_KS, depth: int = 8, prefix_len: int = 256,
                  batch_size: int = 1, repeats: int = 5, warmup: int = 2) -> DeviceCosts:
    """All three parts of T(cfg) on the model's device (random prompt tokens, ``prefix_len`` long). Sizes
    1 and top_k 1 are always measured: the loop overhead is the residual of a chain of one."""
    head.attach(model)
    timing = dict(prefix_len=prefix_len, batch_size=batch_size, repeats=repeats, warmup=warmup)
    with skinny_linears():  # the linears an eager CPU decode runs (it touches CPU fp32 linears only)
        partial = DeviceCosts(verify=measure_verify_cost(model, sorted(set(sizes) | {1}), **timing),
                              draft=measure_draft_cost(head, sorted(set(top_ks) | {1}), depth=depth, **timing))
    fixed = measure_loop_overhead(model, head, partial, decode, prefix_len=prefix_len, batch_size=batch_size,
                                  repeats=repeats)
    return DeviceCosts(verify=partial.verify, draft=partial.draft, fixed=fixed)
