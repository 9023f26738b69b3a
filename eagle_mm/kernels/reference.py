"""Pure-torch tree verification, greedy and sampled: the oracles the Triton kernels must match."""
from __future__ import annotations

import torch

__all__ = ["verify_greedy_reference", "greedy_accept", "path_indices", "rejection_walk"]


def greedy_accept(tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, target_tokens: torch.Tensor,
                  max_depth: int):
    """Longest path whose every node equals the target's argmax at its parent.

    tokens, parent, depth (B, N+1): the tree as ``eagle_mm.decode.tree.Tree`` holds it; target_tokens (B, N+1): the
    target's greedy choice after each node. Returns accept_len (B,) (draft tokens accepted, 0..max_depth) and best
    (B,) the index of the last accepted node (0 = root).
    """
    ok = tokens == target_tokens.gather(1, parent)  # (B, N+1) node matches its parent's choice
    ok[:, 0] = True
    for _ in range(max_depth):  # a node is accepted only if its whole ancestry is
        ok = ok & ok.gather(1, parent)
    # Siblings carry distinct tokens, so at most one node per depth is accepted: the deepest wins.
    score = torch.where(ok, depth, torch.full_like(depth, -1))
    best = score.argmax(dim=1)
    return depth.gather(1, best[:, None]).squeeze(1), best


def path_indices(parent: torch.Tensor, depth: torch.Tensor, best: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Node indices from the root to ``best`` (B,): (B, max_depth+1), position j holds the node at depth j,
    padded past the path's end by repeating ``best`` (callers mask with the accept length)."""
    B = best.shape[0]
    cols = [best]
    for _ in range(max_depth):
        cols.append(parent.gather(1, cols[-1][:, None]).squeeze(1))
    up = torch.stack(cols[::-1], dim=1)  # (B, max_depth+1): ..., grandparent, parent, best
    # Right-align the path at depth(best): the node at depth j sits at column max_depth - depth(best) + j.
    d = depth.gather(1, best[:, None])  # (B, 1)
    j = torch.arange(max_depth + 1, device=best.device).expand(B, -1)
    src = (max_depth - d + j).clamp(max=max_depth)
    return up.gather(1, src)


def verify_greedy_reference(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                            depth: torch.Tensor, max_depth: int, *, with_path: bool = False):
    """logits (B, N+1, V) at the tree nodes, root first -> (accept_len, best, bonus, path or None, target).

    target (B, N+1) = logits.argmax(-1): the target's greedy choice after each node (torch.argmax order:
    ties -> lowest index, NaN beats every number). accept_len, best (B,) as `greedy_accept`; bonus (B,)
    = target at best; path (B, max_depth+1) as `path_indices`. All int64.
    """
    target = logits.argmax(-1)  # (B, N+1)
    accept_len, best = greedy_accept(tree_tokens, parent, depth, target, max_depth)
    bonus = target.gather(1, best[:, None]).squeeze(1)  # (B,)
    path = path_indices(parent, depth, best, max_depth) if with_path else None
    return accept_len.long(), best, bonus, path, target


def _accept(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept draft token x (B,) with probability min(1, p(x)/q(x)); p, q (B, V), u (B,) ~ U[0, 1)."""
    px = p.gather(1, x[:, None]).squeeze(1)
    qx = q.gather(1, x[:, None]).squeeze(1)
    # p(x) >= q(x) gives a ratio >= 1, always accepted since u < 1 (exactly 1 when p and q are equal).
    return u < px / qx.clamp_min(torch.finfo(qx.dtype).tiny)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) (B, V): the target left over after a rejection; p itself if nothing is left."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def _without(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q (B, V) with token x (B,) removed and renormalized (all zeros once q's support is used up)."""
    q = q.scatter(1, x[:, None], 0.0)
    mass = q.sum(-1, keepdim=True)
    return q / mass.clamp_min(torch.finfo(q.dtype).tiny)


def _sample(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Token ~ p (B, V) (need not be normalized) from Exp(1) noise e (B, V): argmax p / e, no host sync."""
    return (p / e.clamp_min(torch.finfo(e.dtype).tiny)).argmax(-1)


def rejection_walk(tokens: torch.Tensor, parent: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u: torch.Tensor,
                   e: torch.Tensor):
    """The walk of ``tree_rejection_sample`` given its noise: u (B, N+1) uniforms, e (B, V) Exp(1).

    Straight-line tensor code (no data-dependent control flow), so it can be compiled or graph-captured:
    eager it is launch-bound (about 20 ms for N = 48, V = 152k on an H200); under
    ``torch.compile(rejection_walk, fullgraph=True, mode="reduce-overhead")`` about 1 ms, bit-identical.
    """
    B, n = tokens.shape
    cur = torch.zeros(B, dtype=torch.long, device=p.device)  # the node whose children are being tried
    accept_len = torch.zeros(B, dtype=torch.long, device=p.device)
    p_cur, q_cur = p[:, 0].float(), q[:, 0].float()  # (B, V) residual target / remaining draft at cur
    # One pass in index order visits each node's children in draw order, and an accepted node's
    # children after it (parents precede children), so the loop is bounded by the tree size alone.
    for j in range(1, n):
        x = tokens[:, j]  # (B,)
        live = (parent[:, j] == cur) & (q_cur.gather(1, x[:, None]).squeeze(1) > 0)  # a candidate now
        acc = live & _accept(p_cur, q_cur, x, u[:, j])
        rej = (live & ~acc)[:, None]
        p_next = torch.where(rej, _residual(p_cur, q_cur), p_cur)
        q_next = torch.where(rej, _without(q_cur, x), q_cur)
        p_cur = torch.where(acc[:, None], p[:, j].float(), p_next)
        q_cur = torch.where(acc[:, None], q[:, j].float(), q_next)
        cur = torch.where(acc, j, cur)
        accept_len += acc
    return accept_len, cur, _sample(p_cur, e)
