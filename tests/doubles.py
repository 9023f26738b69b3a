"""A test double: a real head whose proposals are replaced by the target's own greedy continuation,
with errors injected at chosen positions, to drive acceptance lengths over their whole range."""
from __future__ import annotations

import torch


class ForcedHead:
    """Wraps a head; the entry at position t proposes ``reference[t + 2]`` unless ``wrong[t + 2]``.

    reference (L_total,) is the target's greedy sequence (prompt + continuation) for batch row 0.
    """

    def __init__(self, head, reference: torch.Tensor, wrong: torch.Tensor):
        self._head, self.reference, self.wrong = head, reference, wrong

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def step(self, embeds, hidden, position_ids, mask, past):
        out, logits, kv = self._head.step(embeds, hidden, position_ids, mask, past)
        nxt = (position_ids + 2).clamp(max=self.reference.numel() - 1)
        tok = self.reference[nxt]
        tok = torch.where(self.wrong[nxt], (tok + 1) % logits.shape[-1], tok)
        forced = torch.full_like(logits, -30.0)
        forced.scatter_(-1, tok[..., None], 0.0)
        return out, forced, kv
