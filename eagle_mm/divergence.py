"""Is a difference between speculative and plain greedy decoding a bug, or a rounding near-tie?

Greedy speculative decoding computes each committed token's logits in one tree forward, ``generate`` in one
step-by-step forward: the same math in a different order. In float32 the two agree to far below the logit gaps a
trained model usually leaves, so the tokens are almost always identical (a near-tie below float32's resolution is
rare, not impossible: one occurred on a random 4-layer target). In bfloat16 or float16 the rounding differs by a
few units in the last place, and where the two best tokens' logits are closer than that, the argmax can flip;
everything after that point then differs too. Only the first difference says anything, and only the reference's
logits there tell a flip from a bug.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Divergence", "classify_divergence", "compare_greedy", "reference_logits"]

# A near-tie is a logit gap within this many units in the last place of the largest logit, in the model's dtype:
# the rounding of two forwards that add the same terms in a different order, through every layer, stays within it.
_ULPS = 8


@dataclass(frozen=True)
class Divergence:
    """The verdict on two greedy decodings: "identical", "near-tie" or "MISMATCH".

    index: the first new token that differs (None when identical). margin: the reference's logit gap between the
    two tokens there; resolution: what the dtype can tell apart at that logit's size.
    """

    verdict: str
    index: int | None = None
    margin: float | None = None
    resolution: float | None = None
    dtype: str = "float32"

    @property
    def is_mismatch(self) -> bool:
        return self.verdict == "MISMATCH"

    def __str__(self) -> str:
        if self.verdict == "identical":
            return "identical"
        if self.verdict == "near-tie":
            return (f"diverges at token {self.index} on a numerical near-tie (top-2 margin {self.margin:.3g}, below "
                    f"the {self.dtype} resolution {self.resolution:.3g}); the outputs differ from there on")
        if self.margin is None:
            return f"MISMATCH at token {self.index}: the same tokens, but one output is longer"
        return (f"MISMATCH at token {self.index}: margin {self.margin:.3g} is above the {self.dtype} resolution "
                f"{self.resolution:.3g}, so this is not rounding (a bug: please report it)")


def _first_difference(reference: Sequence[int], speculative: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(reference, speculative)):
        if a != b:
            return i
    return None if len(reference) == len(speculative) else min(len(reference), len(speculative))


def _ids(tokens) -> list[int]:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]


def classify_divergence(reference, speculative, logits: torch.Tensor | None = None, *,
                        dtype: torch.dtype = torch.float32) -> Divergence:
    """Compare two greedy decodings' new tokens (1-D: lists or tensors).

    logits: (V,) the reference model's next-token logits after ``reference[:i]``, where ``i`` is the first
    difference (``reference_logits`` computes them); needed only when the tokens differ. dtype: the model's
    compute dtype, whose resolution decides what a near-tie is. Pure: no model runs here.
    """
    reference, speculative = _ids(reference), _ids(speculative)
    index = _first_difference(reference, speculative)
    name = str(dtype).removeprefix("torch.")
    if index is None:
        return Divergence("identical", dtype=name)
    if index >= min(len(reference), len(speculative)):  # no token differs: one run stopped early
        return Divergence("MISMATCH", index=index, dtype=name)
    if logits is None:
        raise ValueError(f"the outputs differ at new token {index}; pass the reference's logits there "
                         f"(eagle_mm.divergence.reference_logits) to tell a near-tie from a mismatch")
    logits = logits.detach().float().flatten()  # (V,)
    margin = abs(float(logits[reference[index]] - logits[speculative[index]]))
    resolution = _ULPS * torch.finfo(dtype).eps * max(1.0, float(logits.abs().max()))
    verdict = "near-tie" if margin <= resolution else "MISMATCH"
    return Divergence(verdict, index=index, margin=margin, resolution=resolution, dtype=name)


@torch.no_grad()
def reference_logits(model, prefix: torch.Tensor) -> torch.Tensor:
    """One target forward over ``prefix`` (1, L): the (V,) logits of the token that follows it."""
    out = model(input_ids=prefix, attention_mask=torch.ones_like(prefix))
    return out.logits[0, -1]


def compare_greedy(model, reference: torch.Tensor, speculative: torch.Tensor, prompt_length: int) -> Divergence:
    """Classify one row of greedy outputs: reference and speculative are (1, L) sequences, prompt included.

    Runs one forward of ``model`` over the reference's prefix when the tokens differ.
    """
    new_reference = reference[0, prompt_length:].tolist()
    new_speculative = speculative[0, prompt_length:].tolist()
    index = _first_difference(new_reference, new_speculative)
    logits = None
    if index is not None and index < min(len(new_reference), len(new_speculative)):
        logits = reference_logits(model, reference[:, :prompt_length + index])
    return classify_divergence(new_reference, new_speculative, logits, dtype=model.dtype)
