"""Pure tensor functions for draft trees: the global rerank and ancestry (greedy acceptance, the oracle the kernels
match, is ``eagle_mm.kernels.reference.greedy_accept``).

A tree of N draft nodes is stored with its root (the last accepted token) at index 0:
  tokens (B, N+1), parent (B, N+1) (parent[:, 0] = 0, parent[i] < i), depth (B, N+1) (depth[:, 0] = 0).
Nodes are ordered so that a parent always precedes its children.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tree", "select_tree", "ancestors"]


@dataclass
class Tree:
    tokens: torch.Tensor  # (B, N+1) target token ids, root first
    parent: torch.Tensor  # (B, N+1) index of each node's parent (root points to itself)
    depth: torch.Tensor  # (B, N+1) 0 for the root
    source: torch.Tensor | None = None  # (B, N+1) candidate index each node came from (root: -1)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def select_tree(root: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                scores: torch.Tensor, total: int) -> Tree:
    """EAGLE-2 global rerank: keep the ``total`` candidates with the best cumulative log-prob.

    root (B,); tokens, parent, scores (B, M) candidates in creation order, parent is a candidate index
    (-1 = the root); depth (M,) or (B, M). A child's score never exceeds its parent's and parents are
    created first, so a stable sort keeps every chosen node's parent: the result is a connected tree.
    """
    B, M = tokens.shape
    if not 0 < total <= M:
        raise ValueError(f"total={total} must be in [1, {M}] (the number of candidates)")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :total]
    keep = torch.sort(order, dim=-1).values  # (B, N) candidate ids in creation order
    # New index of each kept candidate: 1..N (0 is the root); others map to -1 (never referenced).
    remap = torch.full((B, M + 1), -1, dtype=torch.long, device=tokens.device)
    remap[:, 0] = 0  # candidate parent -1 (shifted to 0) is the root
    remap.scatter_(1, keep + 1, torch.arange(1, total + 1, device=tokens.device).expand(B, -1))
    # Never -1: a child's score never exceeds its parent's (tests/test_tree.py checks connectivity).
    kept_parent = remap.gather(1, parent.gather(1, keep) + 1)
    depth = depth.expand(B, M) if depth.dim() == 1 else depth
    zero = torch.zeros(B, 1, dtype=torch.long, device=tokens.device)
    return Tree(
        tokens=torch.cat((root.view(B, 1), tokens.gather(1, keep)), 1),
        parent=torch.cat((zero, kept_parent), 1),
        depth=torch.cat((zero, depth.gather(1, keep)), 1),
        source=torch.cat((zero - 1, keep), 1),
    )


def ancestors(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(B, N+1) parents -> (B, N+1, N+1) bool, [b, i, j] = node j is node i or an ancestor of it."""
    B, n = parent.shape
    anc = torch.eye(n, dtype=torch.bool, device=parent.device).expand(B, n, n).clone()
    cur = torch.arange(n, device=parent.device).expand(B, n)
    for _ in range(max_depth):
        cur = parent.gather(1, cur)
        anc.scatter_(2, cur.unsqueeze(-1), True)
    return anc
