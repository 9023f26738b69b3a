"""Acceptance: which draft nodes the target keeps.

Greedy: the target's argmax at every node, matched against each child; the deepest node whose whole path
matches wins (``kernels.verify_greedy``: the Triton kernel on CUDA, the torch reference elsewhere). Sampling:
recursive rejection sampling from the target's processed distribution (``sampling.tree_rejection_sample_scores``).
Both read the target's processed scores (the processors run before, in their own step: ``processors.py``) and
return the same three things, which the update step (``steps.update_step``) turns into what the storage keeps. A tree
of the root alone (``TreeConfig.none()``) accepts nothing: the target's own next token is the bonus.
"""
from __future__ import annotations

import torch

from ..kernels import verify_greedy
from ..kernels.reference import path_indices
from .sampling import tree_rejection_sample_scores, walk_noise
from .tree import Tree

__all__ = ["accept"]


def accept(tree: Tree, scores: torch.Tensor, q_nodes: torch.Tensor | None, depth: int,
           generator: torch.Generator | None = None, noise=None):
    """(accept_len (B,), path (B, D+1), bonus (B, 1)) for the target's processed scores (B, N+1, V) at the tree's
    nodes (``processors.process_tree_logits``; greedy without processors: the logits themselves).

    ``q_nodes`` (B, N+1, V): the draft distribution each node's children were drawn from (sampling), or None
    (greedy). ``noise``: sampling's (u, e), drawn already (``sampling.walk_noise``), or None to draw them from
    ``generator``.
    """
    if scores.shape[1] == 1:  # no draft (TreeConfig.none()): the target's own next token, as generate() picks it
        return _root_only(scores, q_nodes is not None, generator, noise)
    if q_nodes is None:
        accept_len, _, bonus, path = verify_greedy(scores, tree.tokens, tree.parent, tree.depth, depth,
                                                   with_path=True)
    else:
        accept_len, best, bonus = tree_rejection_sample_scores(tree, scores, q_nodes, generator, noise=noise)
        path = path_indices(tree.parent, tree.depth, best, depth)  # (B, D+1)
    return accept_len, path, bonus[:, None]



def _root_only(scores: torch.Tensor, sampled: bool, generator, noise):
    """``accept`` for a tree of the root alone, scores (B, 1, V): greedy takes the argmax (``generate``'s own choice),
    sampling draws from the processed distribution with the bonus's Exp(1) noise (argmax p / e, the draw the walk over
    a tree takes for its bonus token)."""
    if sampled:
        B, V = scores.shape[0], scores.shape[-1]
        if noise is None:
            noise = walk_noise(scores.new_empty(B, 1, dtype=torch.float32), scores.new_empty(B, V, dtype=torch.float32),
                               generator)
        e = noise[1]
        bonus = (torch.softmax(scores[:, 0].float(), -1) / e.clamp_min(torch.finfo(e.dtype).tiny)).argmax(-1)  # (B,)
    else:
        bonus = scores[:, 0].argmax(-1)
    zero = torch.zeros_like(bonus)
    return zero, zero[:, None], bonus[:, None]
