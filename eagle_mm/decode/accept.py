"""Acceptance: which draft nodes the target keeps, and the tokens and positions a cycle commits.

Greedy: the target's argmax at every node, matched against each child; the deepest node whose whole path
matches wins (``kernels.verify_greedy``: the Triton kernel on CUDA, the torch reference elsewhere). Sampling:
recursive rejection sampling from the target's processed distribution (``sampling.tree_rejection_sample_scores``).
Both return the same three things, and ``committed`` turns them into what both storages write.
"""
from __future__ import annotations

import torch

from ..kernels import verify_greedy
from .processors import process_tree_logits
from .sampling import tree_rejection_sample_scores, walk_noise
from .tree import Tree, path_indices

__all__ = ["accept", "committed"]


def accept(tree: Tree, logits: torch.Tensor, q_nodes: torch.Tensor | None, processors, rows: list, depth: int,
           generator: torch.Generator | None, noise=None):
    """(accept_len (B,), path (B, D+1), bonus (B, 1), scores (B, N+1, V)) for the target's logits (B, N+1, V) at
    the tree's nodes; ``scores`` are the processed logits the acceptance read.

    ``q_nodes`` (B, N+1, V): the draft distribution each node's children were drawn from (sampling), or None
    (greedy). ``rows``: each row's sequence so far, or its length, for processors that read them (else empty;
    see ``process_tree_logits``). ``noise``: sampling's (u, e), drawn already (``sampling.walk_noise``), or None
    to draw them from ``generator``.
    """
    if tree.size == 1:  # no draft (TreeConfig.none()): the target's own next token, as generate() picks it
        return _root_only(tree, logits, q_nodes is not None, processors, rows, generator, noise)
    if q_nodes is None:
        scores = process_tree_logits(processors, rows, tree, logits, depth) if processors else logits
        accept_len, _, bonus, path = verify_greedy(scores, tree.tokens, tree.parent, tree.depth, depth,
                                                   with_path=True)
    else:
        scores = process_tree_logits(processors, rows, tree, logits, depth)  # (B, N+1, V) fp32
        accept_len, best, bonus = tree_rejection_sample_scores(tree, scores, q_nodes, generator, noise=noise)
        path = path_indices(tree, best, depth)  # (B, D+1)
    return accept_len, path, bonus[:, None], scores


def _root_only(tree: Tree, logits: torch.Tensor, sampled: bool, processors, rows: list, generator, noise):
    """``accept`` for a tree of the root alone (B, 1): greedy takes the argmax (``generate``'s own choice, token for
    token), sampling draws from the processed distribution with the bonus's Exp(1) noise (argmax p / e)."""
    scores = process_tree_logits(processors, rows, tree, logits, 0) if processors or sampled else logits
    if sampled:  # the same draws, in the same order, as the walk over a tree would take (``walk_noise``)
        B, V = scores.shape[0], scores.shape[-1]
        _, e = noise if noise is not None else walk_noise(scores.new_empty(B, 1, dtype=torch.float32),
                                                           scores.new_empty(B, V, dtype=torch.float32), generator)
        bonus = (torch.softmax(scores[:, 0].float(), -1) / e.clamp_min(torch.finfo(e.dtype).tiny)).argmax(-1)
    else:
        bonus = scores[:, 0].argmax(-1)
    zero = torch.zeros_like(bonus)
    return zero, zero[:, None], bonus[:, None], scores


def committed(tokens: torch.Tensor, q_pos: torch.Tensor, accept_len: torch.Tensor, path: torch.Tensor,
              bonus: torch.Tensor):
    """The new tokens (B, K) (path nodes 1..a, then the bonus at column a) and the positions (B, K) of the kept
    path nodes 0..a (-1 past a), for K = D+1 columns; each row's entries past its own path are padding."""
    K = path.shape[1]
    j = torch.arange(K, device=path.device)  # (K,)
    path_next = torch.cat((tokens.gather(1, path[:, 1:]), bonus), 1)  # (B, K)
    new_tok = torch.where(j == accept_len[:, None], bonus, path_next)
    new_pos = torch.where(j <= accept_len[:, None], q_pos.gather(1, path), -1)
    return new_tok, new_pos
