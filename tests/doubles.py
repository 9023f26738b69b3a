"""A test double: a real head whose proposals are replaced by the target's own greedy continuation,
with errors injected at chosen positions, to drive acceptance lengths over their whole range."""
from __future__ import annotations

import torch


class ForcedHead:
    """Wraps a head; in row b the entry at position t proposes ``reference[b, t + 2]`` unless ``wrong[b, t + 2]``.

    reference (B, T) or (T,): the target's greedy sequences indexed by position (no left padding);
    wrong: a bool tensor of the same shape.
    """

    def __init__(self, head, reference: torch.Tensor, wrong: torch.Tensor):
        self._head = head
        self.reference = reference if reference.dim() == 2 else reference[None]
        self.wrong = wrong if wrong.dim() == 2 else wrong[None]

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def step(self, embeds, hidden, position_ids, mask, past):
        out, logits, kv = self._head.step(embeds, hidden, position_ids, mask, past)
        B, Q = position_ids.shape
        nxt = (position_ids + 2).clamp(max=self.reference.shape[1] - 1)
        ref, wrong = self.reference.expand(B, -1), self.wrong.expand(B, -1)
        tok = ref.gather(1, nxt)
        tok = torch.where(wrong.gather(1, nxt), (tok + 1) % logits.shape[-1], tok)
        forced = torch.full_like(logits, -30.0)
        forced.scatter_(-1, tok[..., None], 0.0)
        return out, forced, kv
