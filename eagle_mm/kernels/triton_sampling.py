"""Triton sampling tree verification: the recursive rejection walk of `eagle_mm.decode.sampling.rejection_walk`.

One program per batch row walks the nodes j = 1..N in index order, exactly as the torch walk does, in a
single launch with no host reads. The torch walk takes p = softmax(scores) for every node, B x (N+1) x V
values, and updates (B, V) vectors at every node (launch-bound eager: ~20 ms at N=48, V=152k on an H200).
Here the walk reads only what it needs:

  current target p_cur: either "softmax of scores row r" (an offset plus that row's max and sum of exp,
      found in one online pass over V when the walk moves to r: the root and each accepted node, so at
      most depth + 1 rows are ever normalized) or a residual in a (B, 3, V) fp32 workspace, kept
      UNNORMALIZED with its sum as a scalar normalizer (slots 0 and 1, used in turn: a rejection writes the
      residual into the slot p_cur does not occupy, so an all-zero residual can still keep p_cur).
  remaining draft q_cur: either "q row r" (normalizer 1: the input row is used as given, as torch does)
      or workspace slot 2 with its sum, again unnormalized.

A node that is not a child of the current one costs one scalar load (its parent); a candidate x a few more
(its token, q_cur(x), p_cur(x), u). Accepting x costs one pass over its scores row (the softmax statistics);
rejecting it, one pass over V that writes max(p_cur - q_cur, 0) and q_cur without x and sums both. The
bonus is one more pass: argmax over V of p_cur / max(e, tiny). At B = 1 all of it is one program, so each
pass streams through one SM: the kernel trades bandwidth for having no launches and no wasted rows.

The edge cases are the reference's: a candidate with q_cur(x) == 0 is skipped; acceptance is
u < p_cur(x) / max(q_cur(x), tiny); an all-zero residual keeps p_cur; a draft whose support is used up
stays all zero (normalizer clamped to tiny); bonus ties go to the lowest index, as torch.argmax.

Why it is exact. The walk is the same sequence of decisions as `rejection_walk`, with the same noise (u
per node, e per row), so the proof in `eagle_mm.decode.sampling`'s module docstring applies unchanged: only how
p_cur and q_cur are stored differs, not which distributions they are. Where it may differ from the
reference in the last bits: the softmax sum is accumulated online in lanes (torch sums after a max pass);
a residual is divided by its sum when read rather than once when written; q without x is its unnormalized
values over their new sum rather than normalized values renormalized; and on a GPU exp and division are
the fast approximate instructions (a few ulp). All of these are rounding of the same real numbers, of the
size the torch walk's own rounding has. A difference can change a decision only when u (or the bonus's
race p / e) lands within those few ulp of the threshold (~1e-7 to 1e-6 per decision), and then both
outcomes are what an exact walk gives up to float rounding: the law of the output is the target's either
way; only the bit-equality with the torch walk for a given seed is "almost always", which the tests check
on many trees. Rows whose scores are all -inf give NaN in the reference (softmax of nothing); here too
their result is meaningless.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rejection_walk_triton"]

TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, the reference's clamp


@triton.jit
def _p_at(scores_ptr, work_ptr, p_log, p_off, p_max, p_sum, idx, V):
    """p_cur at token(s) idx < V, normalized: softmax of a scores row (p_log) or a workspace residual.
    Only the source in use is read: the other load's bound is 0 (a bound, not a scalar-and-vector mask,
    which the interpreter mishandles)."""
    n_log = tl.where(p_log, V, 0)
    s = tl.load(scores_ptr + p_off + idx, mask=idx < n_log, other=float("-inf"))
    r = tl.load(work_ptr + p_off + idx, mask=idx < V - n_log, other=0.0)
    return tl.where(p_log, tl.exp(s - p_max), r) / p_sum


@triton.jit
def _q_at(q_ptr, work_ptr, q_in, q_off, idx, V):
    """q_cur at token(s) idx < V, unnormalized: a row of the input q (q_in) or the workspace's slot 2."""
    n_in = tl.where(q_in, V, 0)
    a = tl.load(q_ptr + q_off + idx, mask=idx < n_in, other=0.0)
    c = tl.load(work_ptr + q_off + idx, mask=idx < V - n_in, other=0.0)
    return tl.where(q_in, a, c)


@triton.jit
def _row_stats(scores_ptr, off, V, BLOCK_V: tl.constexpr):
    """(max, sum of exp(s - max)) of scores[off : off + V], one pass, one exp per element."""
    lanes = tl.arange(0, BLOCK_V)
    run_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + lanes
        s = tl.load(scores_ptr + off + idx, mask=idx < V, other=float("-inf"))
        # One exp per element: exp(-|s - max|) scales down whichever side is smaller. It is 0 when either
        # side is -inf (never -inf - -inf); a lane whose max is still -inf has sum 0, so its scale is moot.
        lo = tl.minimum(s, run_max)
        hi = tl.maximum(s, run_max)
        t = tl.exp(lo - tl.where(hi == float("-inf"), 0.0, hi))
        run_sum = tl.where(s > run_max, run_sum * t + 1.0, run_sum + t)
        run_max = hi
    row_max = tl.max(run_max, axis=0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # an all -inf row: sum 0 (then NaN, as torch)
    return row_max, tl.sum(run_sum * tl.exp(run_max - safe_max), axis=0)


@triton.jit
def _reject(scores_ptr, q_ptr, work_ptr, p_log, p_off, p_max, p_sum, q_in, q_off, q_sum, x,
            res_off, q_new_off, V, BLOCK_V: tl.constexpr):
    """One pass after rejecting x: residual max(p_cur - q_cur, 0) -> work[res_off:], q_cur with x zeroed
    -> work[q_new_off:] (in place when q_cur is already there: each lane reads, then writes, its own
    element). Returns both sums: the residual's normalizer and q's new one."""
    lanes = tl.arange(0, BLOCK_V)
    acc_r = tl.zeros((BLOCK_V,), tl.float32)
    acc_q = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + lanes
        live = idx < V
        p = _p_at(scores_ptr, work_ptr, p_log, p_off, p_max, p_sum, idx, V)
        q_raw = _q_at(q_ptr, work_ptr, q_in, q_off, idx, V)
        r = tl.where(live, tl.maximum(p - q_raw / q_sum, 0.0), 0.0)
        keep = tl.where(idx == x, 0.0, q_raw)  # 0 past V (masked loads)
        tl.store(work_ptr + res_off + idx, r, mask=live)
        tl.store(work_ptr + q_new_off + idx, keep, mask=live)
        acc_r += r
        acc_q += keep
    return tl.sum(acc_r, axis=0), tl.sum(acc_q, axis=0)


@triton.jit
def _bonus(scores_ptr, work_ptr, e_ptr, p_log, p_off, p_max, p_sum, e_off, V, BLOCK_V: tl.constexpr):
    """argmax over V of p_cur / max(e, tiny), lowest index on ties (torch.argmax), as one int64 max."""
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full((BLOCK_V,), -1, tl.int64)
    for start in range(0, V, BLOCK_V):
        idx = start + lanes
        p = _p_at(scores_ptr, work_ptr, p_log, p_off, p_max, p_sum, idx, V)
        noise = tl.load(e_ptr + e_off + idx, mask=idx < V, other=1.0)
        val = p / tl.maximum(noise, TINY)
        val = tl.where(val == 0, 0.0, val)  # -0.0 ties +0.0, as in torch
        # val >= 0, so its bits order as the values do (a NaN above all, as in torch); the low half
        # makes a tie go to the lowest index.
        key = (val.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)
        best = tl.maximum(best, tl.where(idx < V, key, -1))
    return 2147483647 - (tl.max(best, axis=0) & 2147483647)


@triton.jit
def _walk_sampling(tokens_ptr, parent_ptr, scores_ptr, q_ptr, u_ptr, e_ptr, work_ptr, out_ptr,
                   B, n_nodes, V, stride_tok, stride_par, stride_sb, stride_sn, stride_qb, stride_qn,
                   stride_u, stride_e, BLOCK_V: tl.constexpr):
    # grid (B,): program b walks row b; out_ptr (3, B) int64 = accept_len, best, bonus.
    b = tl.program_id(0).to(tl.int64)
    work = b * 3 * V  # this row's (3, V) workspace: residual slots 0 and 1, remaining draft slot 2
    # p_cur = softmax(scores[b, 0]); q_cur = q[b, 0] as given (normalizer 1).
    # Typed scalars: loop-carried state must keep one type through every branch.
    yes = tl.program_id(0) >= 0
    one = tl.full((), 1.0, tl.float32)
    from_scores = tl.full((), -1, tl.int32)
    p_log = yes  # p_cur is a scores row (else a workspace slot)
    p_off = b * stride_sb
    p_max, p_sum = _row_stats(scores_ptr, p_off, V, BLOCK_V)
    p_slot = from_scores  # -1 = a scores row, 0 / 1 = that workspace slot
    q_in = yes  # q_cur is a row of q (else workspace slot 2)
    q_off = b * stride_qb
    q_sum = one
    cur = tl.full((), 0, tl.int32)
    accepted = tl.full((), 0, tl.int64)
    for j in range(1, n_nodes):
        if tl.load(parent_ptr + b * stride_par + j).to(tl.int32) == cur:
            x = tl.load(tokens_ptr + b * stride_tok + j).to(tl.int64)
            qx = _q_at(q_ptr, work_ptr, q_in, q_off, x, V) / q_sum
            if qx > 0:  # q_cur(x) == 0: x was drawn after q's support ran out; it takes no part
                px = _p_at(scores_ptr, work_ptr, p_log, p_off, p_max, p_sum, x, V)
                if tl.load(u_ptr + b * stride_u + j) < px / tl.maximum(qx, TINY):
                    # Accept: continue at j with p_j = softmax(scores[b, j]) and q_j = q[b, j].
                    cur = j
                    accepted += 1
                    p_log = yes
                    p_slot = from_scores
                    p_off = b * stride_sb + tl.cast(j, tl.int64) * stride_sn
                    p_max, p_sum = _row_stats(scores_ptr, p_off, V, BLOCK_V)
                    q_in = yes
                    q_off = b * stride_qb + tl.cast(j, tl.int64) * stride_qn
                    q_sum = one
                else:
                    slot = (p_slot == 0).to(tl.int32)  # the residual slot p_cur is not in
                    res_off = work + slot * V
                    r_sum, q_left = _reject(scores_ptr, q_ptr, work_ptr, p_log, p_off, p_max, p_sum, q_in, q_off,
                                            q_sum, x, res_off, work + 2 * V, V, BLOCK_V)
                    # Later reads (scalar ones included) may land on other threads than the writes.
                    tl.debug_barrier()
                    if r_sum > 0:  # else the rejection had probability 0 (rounding): keep p_cur
                        p_log = ~yes
                        p_slot = slot
                        p_off = res_off
                        p_sum = r_sum
                    q_in = ~yes
                    q_off = work + 2 * V
                    q_sum = tl.maximum(q_left, TINY)  # an exhausted draft stays all zero
    bonus = _bonus(scores_ptr, work_ptr, e_ptr, p_log, p_off, p_max, p_sum, b * stride_e, V, BLOCK_V)
    tl.store(out_ptr + b, accepted)
    tl.store(out_ptr + B + b, cur.to(tl.int64))
    tl.store(out_ptr + 2 * B + b, bonus.to(tl.int64))


def _settings(V: int) -> tuple[int, int]:
    """(block_v, num_warps) of the passes over V: the one launch rule (tests shrink block_v to cross chunks)."""
    block_v = min(4096, triton.next_power_of_2(V))
    return block_v, (16 if block_v >= 4096 else 8 if block_v >= 1024 else 4)


def rejection_walk_triton(tokens: torch.Tensor, parent: torch.Tensor, scores: torch.Tensor, q: torch.Tensor,
                          u: torch.Tensor, e: torch.Tensor):
    """`rejection_walk(tokens, parent, softmax(scores, -1), q, u, e)` in one Triton launch.

    scores (B, N+1, V) fp32 processed logits (-inf = masked token), q (B, N+1, V) fp32 draft
    probabilities (rows of childless nodes are not read), u (B, N+1) fp32 uniforms, e (B, V) fp32 Exp(1)
    noise, tokens / parent (B, N+1) integer. Returns int64 (B,) (accept_len, best, bonus). Shapes and
    dtypes are checked by `eagle_mm.kernels.dispatch.verify_sampling`, not here.
    """
    B, n_nodes, V = scores.shape
    tokens, parent, scores, q, u, e = (t if t.stride(-1) == 1 else t.contiguous()
                                       for t in (tokens, parent, scores, q, u, e))
    block_v, num_warps = _settings(V)
    work = torch.empty(B * 3 * V, dtype=torch.float32, device=scores.device)  # (B, 3, V), never read unwritten
    out = torch.empty(3, B, dtype=torch.int64, device=scores.device)
    # One program per row: the walk is sequential, and at B = 1 one SM streams each pass over V.
    _walk_sampling[(B,)](tokens, parent, scores, q, u, e, work, out, B, n_nodes, V, tokens.stride(0),
                         parent.stride(0), scores.stride(0), scores.stride(1), q.stride(0), q.stride(1),
                         u.stride(0), e.stride(0), BLOCK_V=block_v, num_warps=num_warps)
    return out[0], out[1], out[2]
