"""Forced acceptance for benchmarks with random weights: the head runs for real, its proposals are replaced.

Random weights cannot give real acceptance. ``ForcedHead`` wraps any head that has the eagle_mm head
interface (``step(embeds, hidden, position_ids, mask, past) -> (out, logits, kv)``): the head's own
computation runs, then its logits are replaced by a one-hot choice of the target's greedy continuation
(``reference``, indexed by position), made wrong at the positions ``wrong`` marks. Nothing here imports
eagle_mm; the benchmark passes the wrapped head wherever a head is taken.
"""
from __future__ import annotations

import math

import torch


def wrong_positions(length: int, mean_accept: float) -> torch.Tensor:
    """(length,) bool: positions whose proposal is made wrong so that a cycle commits ``mean_accept`` tokens
    on average (accepted drafts + the bonus), as long as the tree is at least ``ceil(mean_accept) - 1`` deep.

    A cycle rooted at position r accepts the proposals up to the first wrong position p > r and commits
    p - r tokens (the target's own token at p is the bonus), so marking every position p where
    floor((p + 1) / tau) > floor(p / tau) gives gaps of floor(tau) or ceil(tau) averaging tau.
    """
    if mean_accept < 1:
        raise ValueError(f"mean_accept={mean_accept} must be >= 1 (a cycle commits at least its bonus token)")
    p = torch.arange(length, dtype=torch.float64)
    return torch.floor((p + 1) / mean_accept) > torch.floor(p / mean_accept)


class ForcedHead:
    """Wraps a head; in row b the entry at position t proposes ``reference[b, t + 2]`` unless ``wrong[b, t + 2]``.

    reference (B, T) or (T,): greedy sequences by position (no left padding); wrong: bool of the same shape.
    ``set_accept`` rewrites ``wrong`` in place, so one instance (and the graphs compiled through it) serves
    every acceptance level.
    """

    def __init__(self, head, reference: torch.Tensor, wrong: torch.Tensor | None = None,
                 draft_index: torch.Tensor | None = None):
        self._head = head
        # (V,) draft id of each target id, -1 outside the draft vocabulary; None: the vocabularies agree.
        self.draft_index = draft_index
        self.reference = (reference if reference.dim() == 2 else reference[None]).clone()
        if wrong is None:
            wrong = torch.zeros_like(self.reference, dtype=torch.bool)
        self.wrong = (wrong if wrong.dim() == 2 else wrong[None]).clone().to(self.reference.device)

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def set_accept(self, mean_accept: float) -> None:
        self.wrong.copy_(wrong_positions(self.wrong.shape[1], mean_accept)[None].expand_as(self.wrong))

    def set_reference(self, reference: torch.Tensor) -> None:
        ref = reference if reference.dim() == 2 else reference[None]
        n = min(ref.shape[1], self.reference.shape[1])
        self.reference[:, :n].copy_(ref[:, :n])

    def step(self, embeds, hidden, position_ids, mask, past):
        out, logits, kv = self._head.step(embeds, hidden, position_ids, mask, past)
        B, Q = position_ids.shape
        nxt = (position_ids + 2).clamp(max=self.reference.shape[1] - 1)
        ref, wrong = self.reference.expand(B, -1), self.wrong.expand(B, -1)
        tok = ref.gather(1, nxt)  # (B, Q) target ids
        bad = wrong.gather(1, nxt)
        if self.draft_index is not None:  # a reduced draft vocabulary: absent tokens cannot be proposed
            tok = self.draft_index[tok]
            bad = bad | (tok < 0)
            tok = tok.clamp(min=0)
        tok = torch.where(bad, (tok + 1) % logits.shape[-1], tok)
        forced = torch.full_like(logits, -30.0)
        forced.scatter_(-1, tok[..., None], 0.0)
        return out, forced, kv


class NoisyHead:
    """Wraps a head; the entry at position t scores every token with fixed noise (seeded per position) and adds
    ``strength`` to ``reference[t + 2]``. The right token then ranks first, second, ... with a probability set by
    ``strength``, so wider trees catch what the top choice misses: an acceptance between ``ForcedHead``'s
    all-or-nothing and a random head's nothing, for benchmarks and tests of tree choices."""

    def __init__(self, head, reference: torch.Tensor, strength: float, seed: int = 0):
        self._head, self.reference, self.strength = head, reference, strength
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(reference.numel(), head.config.vocab_size, generator=g).to(reference.device)

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def step(self, embeds, hidden, position_ids, mask, past):
        out, _, kv = self._head.step(embeds, hidden, position_ids, mask, past)
        nxt = (position_ids + 2).clamp(max=self.reference.numel() - 1)  # (B, Q)
        logits = self.noise[nxt].clone()  # (B, Q, V)
        logits.scatter_add_(-1, self.reference[nxt][..., None], logits.new_full((*nxt.shape, 1), self.strength))
        return out, logits, kv


def min_depth(mean_accept: float) -> int:
    """The tree depth that lets a cycle reach ``mean_accept`` tokens."""
    return max(1, math.ceil(mean_accept) - 1)
