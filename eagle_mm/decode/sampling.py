"""Sampling-mode tree speculation that keeps the target's distribution exactly.

Drafting: every expanded node u draws its k children WITHOUT replacement from its draft distribution
q_u (Gumbel-top-k), in sample order c_1, c_2, ... (``sample_children``); the global rerank ranks them
with ``sibling_scores``. Verification (``tree_rejection_sample``) is recursive rejection sampling over
those candidates (RSD, Jeon et al. 2024). All functions are batched over B rows, draw their randomness
in fixed shapes from an optional ``torch.Generator`` and never sync with the host.
``tree_rejection_sample_scores`` takes the target's processed logits instead of probabilities and runs the
walk through ``eagle_mm.kernels.verify_sampling``: on CUDA a Triton kernel that softmaxes only the rows
the walk visits; elsewhere ``kernels.reference.rejection_walk``, the oracle.

Why the output is exact. At node u let p_1 = p_u (the target's processed distribution after u) and
q_1 = q_u. Drawing without replacement means c_i ~ q_i given c_1..c_{i-1}, where q_i is q_u with
c_1..c_{i-1} removed and renormalized. The verifier accepts c_i with probability min(1, p_i(c_i)/q_i(c_i));
on rejection it moves on with p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i without c_i; when no
candidate is left it samples the bonus token from the current p. Claim: given c_1..c_{i-1} rejected,
the token emitted at u is distributed as p_i. Induction from the last candidate (no candidate: the bonus
is drawn from p_i). Step: p_{i+1} is a function of p_i and q_i only, not of which c_i was drawn, so
  P(emit y) = q_i(y) min(1, p_i(y)/q_i(y)) + P(reject) p_{i+1}(y)
            = min(p_i, q_i)(y) + (1 - sum min(p_i, q_i)) max(p_i - q_i, 0)(y) / sum max(p_i - q_i, 0)
            = min(p_i, q_i)(y) + max(p_i - q_i, 0)(y) = p_i(y),
since sum max(p - q, 0) = 1 - sum min(p, q). After accepting c_i the walk continues at c_i with p_{c_i},
q_{c_i}: the same argument conditioned on the path, so every emitted token follows the target.

Edge cases. A candidate with q_i(c) = 0 (drawn after q's support ran out, or not sampled from q) is
skipped: it takes no part in the argument. The residual max(p_i - q_i, 0) has mass exactly P(reject c_i),
so an all-zero residual can only follow a rejection of probability 0, i.e. float rounding; p_i is kept
then (any choice is exact up to rounding, and it never produces NaN).

What the tree may keep. The argument needs "c_i ~ q_i given everything the verifier conditions on",
including the fact that c_i is in the tree at all. So at every node the kept children must be a prefix
c_1..c_m of the sample order (a gap would hand the verifier c_{i+1} in place of c_i), and whether c_i is
kept may depend on the path and on c_1..c_{i-1}, but not on c_i itself. Ranking c_i by its own draft
probability (e.g. parent + cummin of log q) violates the second condition: the tree then keeps c_i more
often when q(c_i) is large, and the verifier over-accepts likely tokens. ``tests/test_sampling.py``
shows that bias. ``sibling_scores`` ranks c_i by the parent's path probability times the draft mass not
yet drawn, which c_i's own value cannot change; c_i's value still shapes its subtree (its children's
scores), which is fine because the verifier only goes there after conditioning on c_i. The same score
must pick the frontier (the nodes expanded), with ties broken by creation order (a stable sort), as in
the rerank: if a node's own value decided which other nodes get expanded, it could decide which nodes
outrank it. With one score, a node's value moves only its descendants, which rank below it.
"""
from __future__ import annotations

import torch

from ..kernels import verify_sampling
from ..kernels.reference import rejection_walk
from .tree import Tree

__all__ = ["sample_children", "draft_noise", "exp_noise", "walk_noise", "sibling_scores", "tree_rejection_sample",
           "tree_rejection_sample_scores", "rejection_walk"]


def sample_children(logq: torch.Tensor, k: int, generator: torch.Generator | None = None,
                    noise: torch.Tensor | None = None):
    """Draw k children per node without replacement from q = exp(logq) (Gumbel-top-k).

    logq (B, M, V) (any leading shape) processed draft log-probs over the target vocab, -inf where q = 0.
    ``noise``: Exp(1) draws of logq's shape (fp32) to use instead of drawing them here from ``generator`` (what
    lets the draft run inside a CUDA graph: ``draft_noise`` draws a whole draft's worth outside it).
    Returns ids (B, M, k) in sample order and valid (B, M, k): False for draws of q = 0 tokens, which
    only happen once q's support is exhausted, so they always come last.
    """
    V = logq.shape[-1]
    if not 0 < k <= V:
        raise ValueError(f"k={k} children must be in [1, {V}] (the vocabulary size)")
    # -log(E), E ~ Exp(1), is Gumbel(0, 1); the top-k of log q + Gumbel is a sample without replacement
    # in draw order. Clamping E keeps the noise finite, so -inf log-probs stay -inf (never NaN).
    e = noise if noise is not None else exp_noise(torch.empty(logq.shape, dtype=torch.float32, device=logq.device),
                                                  generator)
    keys = logq.float() - e.clamp_min(torch.finfo(torch.float32).tiny).log()
    keys, ids = keys.topk(k, dim=-1)  # (B, M, k), sorted: draw order
    return ids, keys > float("-inf")


def draft_noise(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill ``out`` (B, 1 + (depth-1) * top_k, W) fp32 with the Exp(1) draws of one sampled draft, in the order the
    draft consumes them: the root's row, then top_k rows per level (``draft.draft_candidates``)."""
    return exp_noise(out, generator)


def exp_noise(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill ``out`` (fp32) with Exp(1) draws, in place. On a CPU as -log(1 - U) from uniform draws: torch's
    ``exponential_`` costs about 7x ``uniform_`` there (a batch of 32 rows over a 32k vocabulary: 14.7 against 2.4 ms
    with the log), which was a fifth of a sampled cycle of code-tiny at that batch. 1 - U lies in (0, 1], so every
    draw is finite. On CUDA ``exponential_`` is one fast kernel."""
    if out.device.type == "cuda":
        return out.exponential_(generator=generator)
    return out.uniform_(generator=generator).neg_().log1p_().neg_()


def sibling_scores(parent_score: torch.Tensor, parent_logp: torch.Tensor, logq_children: torch.Tensor) -> torch.Tensor:
    """Rank scores of sampled children for the global rerank (``tree.select_tree``) and the frontier.

    parent_score (B, M): the parent's own rank score (0 for the root); parent_logp (B, M): the draft's
    cumulative log-prob of the parent's path (0 for the root); logq_children (B, M, k): log q_parent of
    each child, in sample order (-inf for invalid draws). Returns (B, M, k):
        score(c_i) = parent_logp + log(1 - sum_{j<i} q(c_j)),
    the path's draft probability times the chance that the next token is none of the earlier siblings:
    an upper bound on log p_draft(path, c_i) that does not look at c_i (see the module docstring). It is
    non-increasing along the sample order and never above the parent's score (exactly so, in floats, by
    the min with parent_score), so a stable descending sort keeps a connected tree in which every node's
    kept children are a prefix of its draws. Invalid draws (after q's support) get -inf.
    """
    q = logq_children.float().exp()  # (B, M, k)
    # Exclusive prefix sums built from earlier draws only (cumsum - q would let q(c_i) leak in by rounding).
    drawn_before = torch.cat((torch.zeros_like(q[..., :1]), torch.cumsum(q[..., :-1], dim=-1)), dim=-1)
    left = torch.log((1 - drawn_before).clamp_min(0))  # log of the mass not drawn yet
    score = torch.minimum(parent_score[..., None], parent_logp[..., None] + left)
    return score.masked_fill(logq_children == float("-inf"), float("-inf"))


def _noise(B: int, n: int, V: int, device: torch.device, generator: torch.Generator | None):
    """All the walk's randomness up front, in fixed shapes: u (B, N+1) one uniform per node, e (B, V) the
    bonus's Exp(1) noise. One order of draws for both entry points, so they agree for a given generator."""
    return walk_noise(torch.empty(B, n, device=device), torch.empty(B, V, device=device), generator)


def walk_noise(u: torch.Tensor, e: torch.Tensor, generator: torch.Generator | None):
    """Fill u (B, N+1) with U(0, 1) and e (B, V) with Exp(1) draws, in that order: the walk's noise, in place."""
    return u.uniform_(generator=generator), exp_noise(e, generator)


def tree_rejection_sample(tree: Tree, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None = None):
    """Recursive rejection sampling down a tree whose siblings were drawn by ``sample_children``.

    tree: tokens/parent (B, N+1), children of a node in draw order (index order); p (B, N+1, V): the
    target's processed distribution after each node; q (B, N+1, V): the draft distribution each node's
    children were drawn from (rows of nodes without children are not read). Returns accept_len (B,)
    (draft tokens accepted), best (B,) (index of the last accepted node, 0 = root) and bonus (B,) (the
    token after it, drawn from the residual target), as ``kernels.reference.greedy_accept`` plus the bonus.
    """
    tokens, parent = tree.tokens, tree.parent
    B, n = tokens.shape
    if p.shape[:2] != (B, n) or q.shape != p.shape:
        raise ValueError(f"p {tuple(p.shape)} and q {tuple(q.shape)} must both be (B, N+1, V) = ({B}, {n}, V)")
    u, e = _noise(B, n, p.shape[-1], p.device, generator)
    return rejection_walk(tokens, parent, p, q, u, e)


def tree_rejection_sample_scores(tree: Tree, scores: torch.Tensor, q: torch.Tensor,
                                 generator: torch.Generator | None = None, *, backend: str | None = None,
                                 noise: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``tree_rejection_sample(tree, softmax(scores, -1), q, generator)`` from the processed logits.

    scores (B, N+1, V): the target's processed logits after each node (-inf = masked token). Same noise
    from the same generator, and the same results (bit for bit on the torch backend; up to last-bit
    rounding on Triton, see ``eagle_mm.kernels.triton_sampling``). ``backend`` as in
    ``eagle_mm.kernels.verify_sampling`` (default: EAGLE_MM_VERIFY_BACKEND, then Triton on CUDA).
    ``noise``: (u (B, N+1), e (B, V)) drawn already, as ``walk_noise`` draws them (the engine draws them outside
    its captured acceptance), instead of drawing them here.
    """
    tokens, parent = tree.tokens, tree.parent
    B, n = tokens.shape
    if scores.shape[:2] != (B, n) or q.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and q {tuple(q.shape)} must both be (B, N+1, V) = "
                         f"({B}, {n}, V)")
    u, e = noise if noise is not None else _noise(B, n, scores.shape[-1], scores.device, generator)
    return verify_sampling(scores, q, tokens, parent, u, e, backend=backend)
