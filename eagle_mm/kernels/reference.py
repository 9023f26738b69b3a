"""Pure-torch greedy tree verification: the oracle the Triton kernel must match bit for bit."""
from __future__ import annotations

import torch

from ..decode.tree import Tree, greedy_accept, path_indices

__all__ = ["verify_greedy_reference"]


def verify_greedy_reference(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                            depth: torch.Tensor, max_depth: int, *, with_path: bool = False):
    """logits (B, N+1, V) at the tree nodes, root first -> (accept_len, best, bonus, path or None, target).

    target (B, N+1) = logits.argmax(-1): the target's greedy choice after each node (torch.argmax order:
    ties -> lowest index, NaN beats every number). accept_len, best (B,) as `greedy_accept`; bonus (B,)
    = target at best; path (B, max_depth+1) as `path_indices`. All int64.
    """
    target = logits.argmax(-1)  # (B, N+1)
    tree = Tree(tokens=tree_tokens, parent=parent, depth=depth)
    accept_len, best = greedy_accept(tree, target, max_depth)
    bonus = target.gather(1, best[:, None]).squeeze(1)  # (B,)
    path = path_indices(tree, best, max_depth) if with_path else None
    return accept_len.long(), best, bonus, path, target
