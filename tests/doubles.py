"""A test double: a real head whose proposals are replaced by the target's own greedy continuation,
with errors injected at chosen positions, to drive acceptance lengths over their whole range."""
from __future__ import annotations

import weakref

import torch

from eagle_mm.decode.state import DecodeState

_ACTIVE = [lambda: None]  # a weak reference to the double that ran last: the one decoding now (tests decode in turn)


class ForcedHead:
    """Wraps a head; in row b the entry at position t proposes ``reference[b, t + 2]`` unless ``wrong[b, t + 2]``.

    reference (B, T) or (T,): the target's greedy sequences indexed by position (no left padding);
    wrong: a bool tensor of the same shape. A real head treats rows alike; this one's tables are per row, so it
    follows the rows the decode loop keeps when others finish (``DecodeState.keep``, patched below): ``rows``.
    """

    def __init__(self, head, reference: torch.Tensor, wrong: torch.Tensor):
        self._head = head
        self.reference = reference if reference.dim() == 2 else reference[None]
        self.wrong = wrong if wrong.dim() == 2 else wrong[None]
        self.rows = None  # storage row i holds the call's row rows[i]; None: all rows, in order

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def attach(self, *args, **kwargs):  # every decode call starts here: all rows, in order
        self.rows = None
        self._head.attach(*args, **kwargs)
        return self

    def step(self, embeds, hidden, position_ids, mask, past):
        _ACTIVE[0] = weakref.ref(self)
        out, logits, kv = self._head.step(embeds, hidden, position_ids, mask, past)
        B, Q = position_ids.shape
        nxt = (position_ids + 2).clamp(max=self.reference.shape[1] - 1)
        ref, wrong = self.reference, self.wrong
        if self.rows is not None and ref.shape[0] > 1:
            ref, wrong = ref[self.rows.to(ref.device)], wrong[self.rows.to(ref.device)]
        ref, wrong = ref.expand(B, -1), wrong.expand(B, -1)
        tok = ref.gather(1, nxt)
        tok = torch.where(wrong.gather(1, nxt), (tok + 1) % logits.shape[-1], tok)
        forced = torch.full_like(logits, -30.0)
        forced.scatter_(-1, tok[..., None], 0.0)
        return out, forced, kv


def _follow_rows():
    """The double decoding now (the last to run a head step) follows the decode state's ``slots`` when the loop
    keeps a subset of its rows."""
    keep = DecodeState.keep

    def kept(self, rows):
        keep(self, rows)
        head = _ACTIVE[0]()
        if head is not None:
            head.rows = torch.tensor(self.slots)

    DecodeState.keep = kept


_follow_rows()
