"""The target's logits processors (HF's own, as ``generate`` builds them) applied at tree nodes.

The distribution after a tree node depends on the path to it, so processors that read ``input_ids``
(repetition penalty, n-gram bans, min length, ...) see the row's sequence plus the node's path.
Processors that ignore ``input_ids`` (temperature, top-k/p, min-p, ...) run once on all nodes.
"""
from __future__ import annotations

import torch
from ..target.generation import INPUT_FREE, LENGTH_ONLY, min_length_rule

__all__ = ["process_tree_logits", "apply_input_free", "reads_input_ids", "reads_tokens", "node_paths",
           "capturable_warpers"]


def _length_only(p, base: list[int], depth: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``p(seq, scores)`` for every node at once: eos masked below the minimum, as the processor does for one
    length. base: each row's sequence length (B ints); depth (B, N+1): a node's sequence is base + depth long;
    scores (B * (N+1), V)."""
    minimum, skip, eos_ids = min_length_rule(p)
    if min(base) - skip >= minimum:  # every node is past the minimum (decided on the host: no device work)
        return scores
    base_t = torch.tensor(base)
    if scores.is_cuda:  # from pinned memory the copy does not wait for the work queued on the GPU
        base_t = base_t.pin_memory()
    lengths = (base_t.to(scores.device, non_blocking=True)[:, None] + depth).flatten()  # (M,)
    eos = torch.isin(torch.arange(scores.shape[-1], device=scores.device), eos_ids.to(scores.device))
    short = (lengths - skip) < minimum  # (M,)
    return scores.masked_fill(short[:, None] & eos[None, :], float("-inf"))


def apply_input_free(processors, scores: torch.Tensor) -> torch.Tensor:
    """Input-free processors (``INPUT_FREE``) on scores (M, V), in order: what ``LogitsProcessorList`` does for
    them, without its signature inspection of every processor on every call (the decode cycle calls this each
    cycle, and the draft once per level)."""
    dummy = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
    for p in processors:
        scores = p(dummy, scores)
    return scores


def reads_input_ids(processors) -> bool:
    """Whether any processor's output may depend on the sequence so far."""
    return any(not isinstance(p, INPUT_FREE) for p in (processors or []))


def reads_tokens(processors) -> bool:
    """Whether any processor reads the tokens so far, not only their number (what ``process_tree_logits`` then
    needs as each row's sequence; the others take each row's length)."""
    return any(not isinstance(p, INPUT_FREE + LENGTH_ONLY) for p in (processors or []))


def capturable_warpers(processors) -> bool:
    """Whether every processor is exactly one of transformers' input-free warpers (not a subclass): the code the
    engine's draft step runs inside its graph."""
    return all(type(p) in INPUT_FREE for p in (processors or []))


def node_paths(parent: torch.Tensor, depth: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(B, N+1) tree -> (B, N+1, max_depth+1): [b, i, j] = the node at depth j on node i's path (j <= depth)."""
    B, n = parent.shape
    cols = [torch.arange(n, device=parent.device).expand(B, n)]
    for _ in range(max_depth):
        cols.append(parent.gather(1, cols[-1]))
    up = torch.stack(cols[::-1], dim=2)  # (B, N+1, D+1): column D - i holds the i-th ancestor
    j = torch.arange(max_depth + 1, device=parent.device)
    src = (max_depth - depth[:, :, None] + j).clamp(max=max_depth)
    return up.gather(2, src)


def process_tree_logits(processors, rows: list, tree, logits: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Processed fp32 scores (B, N+1, V) of the target's logits at every tree node.

    rows[b]: row b's sequence so far (1-D, the root included), as ``generate`` would pass it, or only its length
    (an int) when no processor reads the tokens (``reads_tokens``).
    """
    scores = logits.float()
    if not processors:
        return scores
    B, n, V = scores.shape
    if not reads_input_ids(processors):
        return apply_input_free(processors, scores.reshape(B * n, V)).reshape(B, n, V)
    if all(isinstance(p, INPUT_FREE + LENGTH_ONLY) for p in processors):
        # Lengths only: each node's sequence is its row's plus its depth; one batched call per processor.
        base = [r if isinstance(r, int) else r.numel() for r in rows]
        flat = scores.reshape(B * n, V)
        for p in processors:
            flat = _length_only(p, base, tree.depth, flat) if isinstance(p, LENGTH_ONLY) else \
                apply_input_free([p], flat)
        return flat.reshape(B, n, V)
    paths = tree.tokens.gather(1, node_paths(tree.parent, tree.depth, max_depth).flatten(1)).view(B, n, -1)
    depth = tree.depth.cpu()  # the slow path groups nodes by depth on the host
    out = torch.empty_like(scores)
    for b in range(B):
        for d in range(int(depth[b].max()) + 1):
            nodes = (depth[b] == d).nonzero().flatten().to(scores.device)
            if nodes.numel() == 0:
                continue
            prefix = rows[b].to(scores.device).expand(nodes.numel(), -1)
            seqs = torch.cat((prefix, paths[b, nodes, 1: d + 1]), dim=1)  # (n_d, L_b + d)
            out[b, nodes] = processors(seqs, scores[b, nodes])
    return out
