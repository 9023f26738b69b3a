"""Triton greedy tree verification: argmax over the vocabulary, then the tree walk.

Argmax (`_slice_key`): one program per (row, node, split) streams its slice of the vocabulary in
BLOCK_V chunks and reduces it to the slice's (max, first index), packed in one int64 order key.
Splitting V lets a small tree (few nodes) still fill every SM; with splits=1 it is exactly one program
per (row, node). UNROLL=2 issues two chunks' loads per loop step, so each program keeps more bytes in
flight. The memory floor is reading the (B, N+1, V) logits once; the rest is bytes per node.
Walk (`_walk`): for one row, merges the splits (a max over their keys), then does what
`eagle_mm.tree.greedy_accept` + `path_indices` do, on register vectors of the N+1 nodes.

Two ways to run them, same results bit for bit:
  two launches (default): `_argmax_partial` stores every key, then `_walk_tree` (one program per row).
  one launch (fused=True): `_argmax_walk`; each program stores its key and takes a ticket from its row's
  counter; the program that takes the row's last ticket walks that row and resets the counter to 0.
  It saves a launch and the gap between the two, but measured on an H200 it is no faster (12.2 vs 12.0 us
  at N=64, V=128k; docs/benchmarks.md), so the two-launch path stays the default.

Argmax order is torch.argmax's, bit-exact: the largest value, ties -> lowest index, and any NaN counts
as larger than every number (the first NaN wins). Values are compared after an exact upcast to fp32.
Nothing here reads device memory back to the host.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["verify_greedy_triton"]


@triton.jit
def _order_key(val, idx):
    """(value, index) -> int64 whose max is torch.argmax's winner: the largest value, any NaN above
    every number, then the lowest index. val fp32, idx int32 in [0, 2**31 - 1)."""
    val = tl.where(val == 0, 0.0, val)  # -0.0 ties +0.0, as in torch
    bits = val.to(tl.int32, bitcast=True)
    # Flip the magnitude bits of negatives: the int32 order becomes the float order.
    key = tl.where(val != val, 2147483647, bits ^ ((bits >> 31) & 2147483647))
    return (key.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


@triton.jit
def _take(cur_val, cur_idx, val, idx, inb):
    # Indices grow along a lane, so only a strictly better value moves it: not(val <= cur) is
    # "greater, or val is NaN"; once cur is NaN it stays (the first NaN wins).
    take = inb & ~(val <= cur_val) & (cur_val == cur_val)
    return tl.where(take, val, cur_val), tl.where(take, idx, cur_idx)


@triton.jit
def _step(base, start, lanes, hi, cur_val, cur_idx, BLOCK_V: tl.constexpr, UNROLL: tl.constexpr):
    """Merge UNROLL chunks from ``start`` into the lanes' (max, first index)."""
    idx = start + lanes
    val = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
    if UNROLL == 2:  # both loads issued before either compare: two chunks in flight per program
        idx2 = idx + BLOCK_V
        val2 = tl.load(base + idx2, mask=idx2 < hi, other=float("-inf")).to(tl.float32)
    cur_val, cur_idx = _take(cur_val, cur_idx, val, idx, idx < hi)
    if UNROLL == 2:  # the later chunk second: a lane's indices still grow in merge order
        cur_val, cur_idx = _take(cur_val, cur_idx, val2, idx2, idx2 < hi)
    return cur_val, cur_idx


@triton.jit
def _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n,
               BLOCK_V: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr):
    """Order key (int64 scalar) of logits[r // n_nodes, r % n_nodes, s*chunk : (s+1)*chunk]."""
    b = r // n_nodes
    node = r % n_nodes
    base = logits_ptr + b.to(tl.int64) * stride_b + node.to(tl.int64) * stride_n
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    lanes = tl.arange(0, BLOCK_V)
    # Each lane keeps its own (max, first index); starting at the lane's first index makes a lane of
    # -inf values answer that index, as torch does.
    cur_val = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    cur_idx = lo + lanes
    if STAGES > 1:  # Triton's software pipelining: later chunks' loads issued while this one is compared
        for start in tl.range(lo, hi, BLOCK_V * UNROLL, num_stages=STAGES):
            cur_val, cur_idx = _step(base, start, lanes, hi, cur_val, cur_idx, BLOCK_V, UNROLL)
    else:
        for start in range(lo, hi, BLOCK_V * UNROLL):
            cur_val, cur_idx = _step(base, start, lanes, hi, cur_val, cur_idx, BLOCK_V, UNROLL)
    key = tl.where(cur_idx < hi, _order_key(cur_val, cur_idx), -9223372036854775807)
    return tl.max(key, axis=0)


@triton.jit
def _walk(b, part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
          target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
          n_nodes, S, max_depth, stride_tok, stride_par, stride_dep,
          BLOCK: tl.constexpr, S_TILE: tl.constexpr, WITH_PATH: tl.constexpr, VOLATILE: tl.constexpr):
    """Walk row b's tree; every vector below is (BLOCK,) >= max(N+1, D+1). VOLATILE: read the keys
    past L1, for the fused kernel, where other programs wrote them during this launch."""
    i = tl.arange(0, BLOCK)
    live = i < n_nodes
    rows = b.to(tl.int64) * n_nodes + i  # row-node ids, as the argmax grid numbers them

    # Merge the splits of each node -> the target's argmax after each node (the order keys compose).
    # S_TILE splits per load, all issued at once: a loop of one dependent load per split costs the
    # L2 latency S times over, which dominated small trees (docs/benchmarks.md).
    cols = tl.arange(0, S_TILE)
    key = tl.full((BLOCK,), -9223372036854775807, tl.int64)
    for s0 in range(0, S, S_TILE):
        tile = tl.load(part_key_ptr + rows[:, None] * S + (s0 + cols)[None, :],
                       mask=live[:, None] & ((s0 + cols) < S)[None, :], other=-9223372036854775807,
                       volatile=VOLATILE)  # (BLOCK, S_TILE)
        key = tl.maximum(key, tl.max(tile, axis=1))
    target = 2147483647 - (key & 2147483647)  # (BLOCK,) int64: the index half of the key
    tl.store(target_ptr + rows, target, mask=live)

    tokens = tl.load(tokens_ptr + b.to(tl.int64) * stride_tok + i, mask=live, other=-1).to(tl.int64)
    parent = tl.load(parent_ptr + b.to(tl.int64) * stride_par + i, mask=live, other=0).to(tl.int32)
    depth = tl.load(depth_ptr + b.to(tl.int64) * stride_dep + i, mask=live, other=0).to(tl.int64)

    # greedy_accept, step for step: a node matches its parent's choice, then max_depth rounds of
    # "and my parent's flag" (enough for any tree whose depth is at most max_depth).
    ok = (tokens == tl.gather(target, parent, 0)) | (i == 0)
    ok = ok & live
    for _step in range(0, max_depth):
        ok = ok & (tl.gather(ok.to(tl.int32), parent, 0) != 0)
    # The deepest accepted node, lowest index on ties (torch.argmax order); the root is always ok.
    score = tl.where(ok, depth, -1)
    score = tl.where(live, score, -9223372036854775807)
    top = tl.max(score, axis=0)
    best = tl.min(tl.where(live & (score == top), i, BLOCK), axis=0)
    on_best = i == best
    accept = tl.sum(tl.where(on_best, depth, 0), axis=0)
    bonus = tl.sum(tl.where(on_best, target, 0), axis=0)
    tl.store(accept_ptr + b, accept)
    tl.store(best_ptr + b, best.to(tl.int64))
    tl.store(bonus_ptr + b, bonus)

    if WITH_PATH:
        # path_indices: column j holds parent^max(d - j, 0)(best), d = depth[best]; j in [0, max_depth].
        node = tl.full((BLOCK,), 0, tl.int32) + best
        hops = accept - i.to(tl.int64)  # (BLOCK,) hops still to take in column j = i
        for step in range(0, max_depth):
            node = tl.where(step < hops, tl.gather(parent, node, 0), node)
        tl.store(path_ptr + b.to(tl.int64) * (max_depth + 1) + i, node.to(tl.int64), mask=i <= max_depth)


@triton.jit
def _argmax_partial(logits_ptr, part_key_ptr, n_nodes, V, chunk, stride_b, stride_n, S,
                    BLOCK_V: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr):
    # grid (B * (N+1), S): program (row-node r, split s) -> part_key[r, s].
    r = tl.program_id(0)
    s = tl.program_id(1)
    key = _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, UNROLL, STAGES)
    tl.store(part_key_ptr + r.to(tl.int64) * S + s, key)


@triton.jit
def _walk_tree(part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
               target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
               n_nodes, S, max_depth, stride_tok, stride_par, stride_dep,
               BLOCK: tl.constexpr, S_TILE: tl.constexpr, WITH_PATH: tl.constexpr):
    # grid (B,): one program walks one row's tree; the keys come from the previous launch.
    _walk(tl.program_id(0), part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
          target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
          n_nodes, S, max_depth, stride_tok, stride_par, stride_dep, BLOCK, S_TILE, WITH_PATH, False)


@triton.jit
def _argmax_walk(logits_ptr, part_key_ptr, count_ptr, tokens_ptr, parent_ptr, depth_ptr,
                 target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
                 n_nodes, V, chunk, stride_b, stride_n, S, max_depth, stride_tok, stride_par, stride_dep,
                 BLOCK_V: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr, BLOCK: tl.constexpr,
                 S_TILE: tl.constexpr, WITH_PATH: tl.constexpr):
    # grid (B * (N+1), S), as _argmax_partial; count_ptr: (>= B,) int32, all 0 on entry and on exit.
    r = tl.program_id(0)
    s = tl.program_id(1)
    key = _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, UNROLL, STAGES)
    tl.store(part_key_ptr + r.to(tl.int64) * S + s, key)
    # The key store and the atomic may be issued by different threads: the barrier orders them inside
    # the CTA, and the atomic's release (cumulative in the PTX model) then publishes the key GPU-wide.
    tl.debug_barrier()
    b = r // n_nodes
    ticket = tl.atomic_add(count_ptr + b, 1, sem="acq_rel", scope="gpu")
    # No program ever waits, so this cannot deadlock however many programs are resident. The last
    # ticket's acquire makes every other program's key of row b visible to the walk that follows;
    # the walk reads them volatile so that no line cached in L1 earlier in this launch is reused.
    if ticket == n_nodes * S - 1:
        _walk(b, part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
              target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
              n_nodes, S, max_depth, stride_tok, stride_par, stride_dep, BLOCK, S_TILE, WITH_PATH, True)
        # Every ticket of row b is taken, so nobody else touches it in this launch: ready for the next
        # call (and for CUDA-graph replay, which never re-zeroes it).
        tl.store(count_ptr + b, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pick_splits(rows: int, V: int, block_v: int, device: torch.device, programs_per_sm: int) -> int:
    """Enough programs to fill every SM ``programs_per_sm`` times, never more splits than chunks."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    want = -(-programs_per_sm * _sm_count(index) // rows)
    return max(1, min(want, -(-V // block_v), 64))


_MERGE_TILE = 8192  # int64 keys per merge load in the walk (tests shrink it to run several tiles)

# Fused-kernel ticket counters, one int32 per batch row, per device. Zeroed once when allocated (a
# per-call torch.zeros would cost a memset launch); each call's walkers put them back to 0. One buffer
# per device: fused calls on one device must not run concurrently on different streams.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: a captured CUDA graph may still use them


def _row_counters(device: torch.device, B: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < B:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Inside a capture the zero-fill would only run at replay: eager calls would see garbage.
            raise RuntimeError(f"fused verify: call it once with B >= {B} before CUDA-graph capture, so "
                               "its counter buffer exists")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(64, triton.next_power_of_2(B)), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def verify_greedy_triton(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                         depth: torch.Tensor, max_depth: int, *, with_path: bool = False,
                         splits: int | None = None, block_v: int | None = None, num_warps: int | None = None,
                         programs_per_sm: int = 4, fused: bool = False, unroll: int = 1, stages: int = 1,
                         walk_warps: int | None = None):
    """Triton greedy verification; see `eagle_mm.kernels.dispatch.verify_greedy` for the contract.

    Returns (accept_len, best, bonus, path or None, target) with target (B, N+1) the per-node argmax.
    ``splits`` / ``block_v`` / ``num_warps`` / ``programs_per_sm`` / ``unroll`` (1 or 2 chunks per loop
    step) tune the argmax (tests use them to exercise every branch; the defaults come from
    bench/bench_verify.py --tilings on an H200). ``fused``: one launch instead of two. Both options are
    bit-exact on an H200 as under the interpreter; timed there (2026-11-29) fused was no faster and
    unroll=2 gained 7% at one shape only, so the defaults stay False and 1.
    """
    B, n_nodes, V = logits.shape
    if max(n_nodes, max_depth + 1) > 1024:
        raise ValueError(f"the walk holds at most 1024 nodes per row, got max(N+1, max_depth+1) = "
                         f"{max(n_nodes, max_depth + 1)}")
    if unroll not in (1, 2):
        raise ValueError(f"unroll must be 1 or 2, got {unroll!r}")
    if not isinstance(stages, int) or not 1 <= stages <= 8:
        raise ValueError(f"stages must be an int in [1, 8], got {stages!r}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tree_tokens, parent, depth = (t if t.stride(-1) == 1 else t.contiguous() for t in (tree_tokens, parent, depth))
    block_v = block_v or min(2048, triton.next_power_of_2(V))
    num_warps = num_warps or (8 if block_v >= 2048 else 4)
    S = splits or _pick_splits(B * n_nodes, V, block_v, logits.device, programs_per_sm)
    # Each split covers whole BLOCK_V chunks; drop splits that would start past V.
    chunk = triton.cdiv(triton.cdiv(V, S), block_v) * block_v
    S = triton.cdiv(V, chunk)

    # One allocation (host time counts at these sizes), cut into contiguous int64 pieces.
    sizes = (B * n_nodes * S, B * n_nodes, B, B, B, B * (max_depth + 1) if with_path else 0)
    buf = torch.empty(sum(sizes), dtype=torch.int64, device=logits.device)
    part_key, target, accept, best, bonus, path = torch.split(buf, sizes)  # part_key: (B*(N+1), S) keys
    target, path = target.view(B, n_nodes), path.view(B, -1)
    block = triton.next_power_of_2(max(n_nodes, max_depth + 1))
    s_tile = min(triton.next_power_of_2(S), max(1, _MERGE_TILE // block))  # (block, s_tile) keys per load
    outputs = (target, accept, best, bonus, path if with_path else best)  # a dummy path when unused
    walk_args = (n_nodes, S, max_depth, tree_tokens.stride(0), parent.stride(0), depth.stride(0))
    if fused:
        # The walk runs in the argmax's warps; it is only ~N+1 lanes of work, on one program per row.
        _argmax_walk[(B * n_nodes, S)](logits, part_key, _row_counters(logits.device, B), tree_tokens, parent,
                                       depth, *outputs, n_nodes, V, chunk, logits.stride(0), logits.stride(1), S,
                                       *walk_args[2:], BLOCK_V=block_v, UNROLL=unroll, STAGES=stages, BLOCK=block,
                                       S_TILE=s_tile, WITH_PATH=with_path, num_warps=num_warps)
    else:
        _argmax_partial[(B * n_nodes, S)](logits, part_key, n_nodes, V, chunk, logits.stride(0), logits.stride(1),
                                          S, BLOCK_V=block_v, UNROLL=unroll, STAGES=stages, num_warps=num_warps)
        _walk_tree[(B,)](part_key, tree_tokens, parent, depth, *outputs, *walk_args,
                         BLOCK=block, S_TILE=s_tile, WITH_PATH=with_path,
                         num_warps=walk_warps or (4 if block <= 256 else 8))
    return accept, best, bonus, (path if with_path else None), target
