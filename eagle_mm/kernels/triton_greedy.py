"""Triton greedy tree verification: argmax over the vocabulary, then the tree walk, in two launches.

Launch 1 (`_argmax_partial`): one program per (row, node, split) streams its slice of the vocabulary
in BLOCK_V chunks and writes the slice's (max, first index), packed in one int64 order key. Splitting
V lets a small tree (few nodes) still fill every SM; with splits=1 it is exactly one program per
(row, node). The memory floor is reading the (B, N+1, V) logits once; the rest is bytes per node.
Launch 2 (`_walk_tree`): one program per row merges the splits (a max over their keys), then does what
`eagle_mm.tree.greedy_accept` + `path_indices` do, on register vectors of the N+1 nodes.

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
def _argmax_partial(logits_ptr, part_key_ptr, n_nodes, V, chunk, stride_b, stride_n, S,
                    BLOCK_V: tl.constexpr):
    # grid (B * (N+1), S): program (row-node r, split s) reduces logits[r, s*chunk : (s+1)*chunk].
    r = tl.program_id(0)
    s = tl.program_id(1)
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
    for start in range(lo, hi, BLOCK_V):
        idx = start + lanes
        inb = idx < hi
        val = tl.load(base + idx, mask=inb, other=float("-inf")).to(tl.float32)
        # Indices grow along a lane, so only a strictly better value moves it: not(val <= cur) is
        # "greater, or val is NaN"; once cur is NaN it stays (the first NaN wins).
        take = inb & ~(val <= cur_val) & (cur_val == cur_val)
        cur_val = tl.where(take, val, cur_val)
        cur_idx = tl.where(take, idx, cur_idx)
    key = tl.where(cur_idx < hi, _order_key(cur_val, cur_idx), -9223372036854775807)
    tl.store(part_key_ptr + r.to(tl.int64) * S + s, tl.max(key, axis=0))


@triton.jit
def _walk_tree(part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
               target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
               n_nodes, S, max_depth, stride_tok, stride_par, stride_dep,
               BLOCK: tl.constexpr, WITH_PATH: tl.constexpr):
    # grid (B,): one program walks one row's tree; every vector below is (BLOCK,) >= max(N+1, D+1).
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    live = i < n_nodes
    rows = b.to(tl.int64) * n_nodes + i  # row-node ids, as launch 1 numbered them

    # Merge the splits of each node -> the target's argmax after each node (the order keys compose).
    key = tl.load(part_key_ptr + rows * S, mask=live, other=0)
    for s in range(1, S):
        key = tl.maximum(key, tl.load(part_key_ptr + rows * S + s, mask=live, other=0))
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


def verify_greedy_triton(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                         depth: torch.Tensor, max_depth: int, *, with_path: bool = False,
                         splits: int | None = None, block_v: int | None = None, num_warps: int | None = None,
                         programs_per_sm: int = 4):
    """Triton greedy verification; see `eagle_mm.kernels.dispatch.verify_greedy` for the contract.

    Returns (accept_len, best, bonus, path or None, target) with target (B, N+1) the per-node argmax.
    ``splits`` / ``block_v`` / ``num_warps`` / ``programs_per_sm`` tune launch 1 (tests use them to
    exercise every branch; the defaults come from bench/bench_verify.py --tilings on an H200).
    """
    B, n_nodes, V = logits.shape
    if max(n_nodes, max_depth + 1) > 1024:
        raise ValueError(f"the walk holds at most 1024 nodes per row, got max(N+1, max_depth+1) = "
                         f"{max(n_nodes, max_depth + 1)}")
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
    _argmax_partial[(B * n_nodes, S)](logits, part_key, n_nodes, V, chunk,
                                      logits.stride(0), logits.stride(1), S, BLOCK_V=block_v, num_warps=num_warps)
    block = triton.next_power_of_2(max(n_nodes, max_depth + 1))
    _walk_tree[(B,)](part_key, tree_tokens, parent, depth, target, accept, best, bonus, path if with_path else best,
                     n_nodes, S, max_depth, tree_tokens.stride(0), parent.stride(0), depth.stride(0),
                     BLOCK=block, WITH_PATH=with_path, num_warps=4 if block <= 256 else 8)
    return accept, best, bonus, (path if with_path else None), target
