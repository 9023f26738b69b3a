"""FeatureCapture returns exactly HF's ``output_hidden_states=True`` states, and leaves no hooks behind."""
from __future__ import annotations

import pytest
import torch

from eagle_mm.hf.parts import resolve_target
from eagle_mm.hf.features import FeatureCapture
from tests.tiny import module_hooks, prompt, tiny_model

N = 6  # layers of the tiny models
H = 64


def _reference(model, **inputs) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    assert len(out.hidden_states) == N + 1
    return out.hidden_states


def _captured(model, indices, **inputs) -> torch.Tensor:
    with FeatureCapture(resolve_target(model), indices) as cap, torch.no_grad():
        model(**inputs)
    return cap.features()


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_every_index_equals_hf_hidden_states(family):
    model = tiny_model(family)
    ids = prompt(7, batch=2)
    ref = _reference(model, input_ids=ids)
    feats = _captured(model, tuple(range(N + 1)), input_ids=ids)
    assert feats.shape == (2, 7, (N + 1) * H)
    for i, got in enumerate(feats.split(H, dim=-1)):
        torch.testing.assert_close(got, ref[i], rtol=0, atol=0, msg=f"{family} hidden_states[{i}]")


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_index_zero_is_the_scaled_embedding_and_n_the_normed_output(family):
    model = tiny_model(family)
    ids = prompt(5)
    feats = _captured(model, (0, N), input_ids=ids)
    emb = model.get_input_embeddings()(ids)
    if family == "gemma3_text":  # gemma multiplies embeddings by sqrt(hidden): index 0 is after the scaling
        raw = torch.nn.functional.embedding(ids, model.get_input_embeddings().weight)
        assert not torch.allclose(raw, emb)
    torch.testing.assert_close(feats[..., :H], emb, rtol=0, atol=0)
    with torch.no_grad():
        last = model.get_decoder()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(feats[..., H:], last, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_order_and_repeats_follow_the_requested_indices(family):
    model = tiny_model(family)
    ids = prompt(6, batch=3, seed=4)
    ref = _reference(model, input_ids=ids)
    indices = (5, 0, N, 2, 5)
    feats = _captured(model, indices, input_ids=ids)
    assert feats.shape == (3, 6, len(indices) * H)
    for got, i in zip(feats.split(H, dim=-1), indices):
        torch.testing.assert_close(got, ref[i], rtol=0, atol=0)


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_inputs_embeds_instead_of_input_ids(family):
    model = tiny_model(family)
    ids = prompt(6, batch=2, seed=2)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    ref = _reference(model, input_ids=ids)
    feats = _captured(model, (0, 3, N), inputs_embeds=embeds)
    for got, i in zip(feats.split(H, dim=-1), (0, 3, N)):
        torch.testing.assert_close(got, ref[i], rtol=0, atol=0)


def test_padded_batch_with_attention_mask_matches_hf():
    model = tiny_model("llama")
    ids = prompt(6, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ref = _reference(model, input_ids=ids, attention_mask=mask)
    feats = _captured(model, (1, 4, N), input_ids=ids, attention_mask=mask)
    for got, i in zip(feats.split(H, dim=-1), (1, 4, N)):
        torch.testing.assert_close(got, ref[i], rtol=0, atol=0)


def test_features_are_cleared_and_missing_ones_raise():
    model = tiny_model("llama")
    cap = FeatureCapture(resolve_target(model), (0, N))
    with cap, torch.no_grad():
        model(input_ids=prompt(4))
        first = cap.features()
        with pytest.raises(RuntimeError, match=r"\[0, 6\]"):
            cap.features()  # features() clears what it returned
        model(input_ids=prompt(3, seed=9))
        second = cap.features()
    assert first.shape[1] == 4 and second.shape[1] == 3


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_hooks_exist_only_inside_the_with_block(family):
    model = tiny_model(family)
    _reference(model, input_ids=prompt(3))  # let HF install its own recording hooks first
    before = module_hooks(model)
    cap = FeatureCapture(resolve_target(model), (0, 2, N))
    with cap:
        inside = module_hooks(model)
        with torch.no_grad():
            model(input_ids=prompt(4))
    assert inside != before  # the capture did register hooks (so the check below means something)
    assert module_hooks(model) == before
    cap.features()


def test_hooks_are_removed_when_the_forward_raises():
    model = tiny_model("llama")
    before = module_hooks(model)
    with pytest.raises(IndexError):
        with FeatureCapture(resolve_target(model), (1, N)), torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 10_000]]))  # out of the vocabulary
    assert module_hooks(model) == before == {}
    # The same capture object cannot leak hooks through re-entry either.
    cap = FeatureCapture(resolve_target(model), (1,))
    for _ in range(2):
        with cap, torch.no_grad():
            model(input_ids=prompt(2))
        cap.features()
    assert module_hooks(model) == {}


@pytest.mark.parametrize("bad", [N + 1, 99, -1])
def test_out_of_range_index_raises_naming_it(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"\[{bad}\].*\[0, {N}\]"):
        FeatureCapture(resolve_target(model), (0, bad, 3))
    assert module_hooks(model) == {}
