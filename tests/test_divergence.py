"""eagle_mm.divergence: identical, a near-tie that rounding flips, or a MISMATCH (a bug)."""
from __future__ import annotations

import pytest
import torch

from eagle_mm.divergence import classify_divergence, compare_greedy, reference_logits
from tests.tiny import prompt, tiny_model


def _logits(values: dict[int, float], vocab: int = 8) -> torch.Tensor:
    logits = torch.full((vocab,), -5.0)
    for token, value in values.items():
        logits[token] = value
    return logits


def test_identical_outputs_are_identical():
    verdict = classify_divergence([3, 1, 4], torch.tensor([3, 1, 4]))
    assert verdict.verdict == "identical" and str(verdict) == "identical" and not verdict.is_mismatch


def test_a_constructed_near_tie_is_labelled_as_one():
    # the reference took token 4 by 0.01 over token 2: below what bf16 resolves at a logit of 12
    verdict = classify_divergence([3, 1, 4, 4], [3, 1, 2, 0], _logits({4: 12.0, 2: 11.99}), dtype=torch.bfloat16)
    assert verdict.verdict == "near-tie" and verdict.index == 2 and not verdict.is_mismatch
    assert verdict.margin == pytest.approx(0.01, abs=1e-5)
    assert str(verdict).startswith("diverges at token 2 on a numerical near-tie (top-2 margin 0.01")


def test_the_same_gap_in_float32_is_a_mismatch():
    verdict = classify_divergence([3, 1, 4], [3, 1, 2], _logits({4: 12.0, 2: 11.99}), dtype=torch.float32)
    assert verdict.verdict == "MISMATCH" and verdict.is_mismatch and "MISMATCH at token 2" in str(verdict)


def test_a_wrong_token_is_a_mismatch():
    # token 6 is far below the reference's choice: no rounding explains it, in any dtype
    verdict = classify_divergence([5, 4], [5, 6], _logits({4: 9.0, 2: 8.5}), dtype=torch.bfloat16)
    assert verdict.verdict == "MISMATCH" and verdict.index == 1 and verdict.margin == pytest.approx(14.0)


def test_equal_tokens_of_different_lengths_are_a_mismatch():
    verdict = classify_divergence([5, 4, 7], [5, 4])
    assert verdict.verdict == "MISMATCH" and verdict.index == 2 and "one output is longer" in str(verdict)


def test_differing_tokens_need_the_reference_logits():
    with pytest.raises(ValueError, match="differ at new token 1; pass the reference's logits there"):
        classify_divergence([5, 4], [5, 6])


def test_compare_greedy_reads_the_logits_at_the_first_difference():
    model = tiny_model("llama").eval()
    ids = prompt(5)
    reference = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert compare_greedy(model, reference, reference.clone(), 5).verdict == "identical"
    logits = reference_logits(model, reference[:, :5 + 3])  # (V,) before new token 3
    runner_up = int(logits.topk(2).indices[1])
    wrong = reference.clone()
    wrong[0, 5 + 3] = runner_up
    verdict = compare_greedy(model, reference, wrong, 5)
    # fp32: a random model's top-2 gap is far above float32's resolution
    assert verdict.verdict == "MISMATCH" and verdict.index == 3
    assert verdict.margin == pytest.approx(float(logits.max() - logits[runner_up]), rel=1e-4)
