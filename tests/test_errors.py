"""Clear errors from the public API: each names the offending value; none leaves hooks on the target."""
from __future__ import annotations

import re

import pytest
import torch
import transformers as tf

import eagle_mm as em
from eagle_mm.hf.parts import SUPPORTED_VLMS, resolve_target
from tests.tiny import module_hooks, prompt, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def head(model):
    return em.Eagle3Head.from_target(model)


def _no_layer_pre_hooks(model) -> bool:
    return all(not layer._forward_pre_hooks for layer in model.get_decoder().layers)


def _fails(model, head, exc, match, **kwargs):
    """speculative_generate raises ``exc`` matching ``match`` and leaves the target's hooks as they were."""
    before = module_hooks(model)
    kwargs.setdefault("max_new_tokens", 3)
    with pytest.raises(exc, match=match):
        em.speculative_generate(model, head, **kwargs)
    assert _no_layer_pre_hooks(model)
    assert module_hooks(model) == before


# ---- input_ids / attention_mask --------------------------------------------------------------------
def test_input_ids_wrong_dtype(model, head):
    _fails(model, head, ValueError, "float32", input_ids=prompt(5).float())


def test_input_ids_wrong_dim(model, head):
    _fails(model, head, ValueError, r"\(5,\)", input_ids=prompt(5)[0])


@pytest.mark.compat
def test_empty_prompt(model, head):
    _fails(model, head, ValueError, r"\(1, 0\)", input_ids=prompt(5)[:, :0])


def test_empty_batch(model, head):
    _fails(model, head, ValueError, r"\(0, 5\)", input_ids=prompt(5, batch=2)[:0])


def test_attention_mask_shape_mismatch(model, head):
    _fails(model, head, ValueError, r"\(1, 4\).*\(1, 5\)", input_ids=prompt(5),
           attention_mask=torch.ones(1, 4, dtype=torch.long))


def test_attention_mask_shape_mismatch_with_padding(model, head):
    mask = torch.tensor([[0, 1, 1, 1]])
    _fails(model, head, ValueError, r"\(1, 4\).*\(1, 5\)|\(1, 5\).*\(1, 4\)", input_ids=prompt(5), attention_mask=mask)


@pytest.mark.compat
def test_right_padded_batch(model, head):
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    _fails(model, head, ValueError, "right-padded", input_ids=prompt(5, batch=2), attention_mask=mask)


# ---- generation options ----------------------------------------------------------------------------
@pytest.mark.compat
def test_num_beams(model, head):
    _fails(model, head, ValueError, "num_beams=2", input_ids=prompt(4), num_beams=2)


def test_num_return_sequences(model, head):
    _fails(model, head, ValueError, r"num_return_sequences.*2|2.*num_return_sequences", input_ids=prompt(4),
           num_return_sequences=2)


def test_unknown_kwarg(model, head):
    _fails(model, head, ValueError, "foo", input_ids=prompt(4), foo=1)


def test_use_cache_false(model, head):
    _fails(model, head, ValueError, "use_cache=False", input_ids=prompt(4), use_cache=False)


def test_custom_generate_is_ours_to_set(model, head):
    _fails(model, head, ValueError, "custom_generate", input_ids=prompt(4), custom_generate=lambda *a, **k: None)


@pytest.mark.parametrize("tree", [(3, 2, 4), 5])
def test_tree_not_a_tree_config(model, head, tree):
    _fails(model, head, TypeError, re.escape(f"tree={tree!r}: expected a TreeConfig"), input_ids=prompt(4), tree=tree)


def test_assistant_model_is_refused(model, head):
    """generate()'s assisted decoding takes a whole draft model; speculative_generate drafts with the head."""
    assistant = tiny_model("llama", num_hidden_layers=1)
    calls = []
    handle = assistant.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        _fails(model, head, ValueError, r"assistant_model=LlamaForCausalLM.*drafts with the head.*drop",
               input_ids=prompt(4), assistant_model=assistant)
    finally:
        handle.remove()
    assert calls == []


def test_a_fractional_max_new_tokens_is_taken_as_generate_takes_it(model, head):
    ids = prompt(6)
    out = em.speculative_generate(model, head, ids, max_new_tokens=2.5, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=2.5, do_sample=False))


def test_a_causal_lm_as_the_head(model):
    other = tiny_model("llama", num_hidden_layers=1)
    _fails(model, other, TypeError, r"head must be an EagleHead/Eagle3Head, got LlamaForCausalLM.*load_head",
           input_ids=prompt(4))


def test_input_ids_on_the_meta_device(model, head):
    ids = torch.zeros(1, 5, dtype=torch.long, device="meta")
    _fails(model, head, ValueError, r"input_ids.*meta device.*no data", input_ids=ids)
    _fails(model, head, ValueError, r"attention_mask.*meta device.*no data", input_ids=prompt(5),
           attention_mask=torch.ones(1, 5, dtype=torch.long, device="meta"))


def test_tree_top_k_larger_than_draft_vocab(model, head):
    tree = em.TreeConfig(depth=2, top_k=200, total_tokens=10)
    _fails(model, head, ValueError, "top_k=200", input_ids=prompt(4), tree=tree)


# ---- the target ------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_attention_implementation_without_4d_masks(impl):
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    model.config._attn_implementation = impl
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=impl):
            em.speculative_generate(model, head, input_ids=prompt(4), max_new_tokens=3)
    finally:
        handle.remove()
    assert calls == []  # refused before any forward
    assert module_hooks(model) == {}


@pytest.mark.compat
@pytest.mark.parametrize("kind", [em.EagleHead, em.Eagle3Head])
@pytest.mark.parametrize("change,match", [(dict(hidden_size=32), r"64.*32"), (dict(vocab_size=80), r"96.*80")])
def test_head_for_another_target(kind, change, match):
    m1, m2 = tiny_model("llama"), tiny_model("llama", **change)
    head = kind.from_target(m1)
    _fails(m2, head, ValueError, match, input_ids=prompt(4).clamp(max=79))
    with pytest.raises(ValueError, match=match):
        head.attach(m2)


def test_eagle3_aux_layer_out_of_range(model):
    with pytest.raises(ValueError, match=r"99.*6 layers|6 layers.*99"):
        em.Eagle3Head.from_target(model, aux_layers=(0, 3, 99))
    # The same check guards a head built from a config, then attached.
    head = em.Eagle3Head(em.Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=96, aux_layers=(0, 7, 3)))
    with pytest.raises(ValueError, match=r"\[7\]"):
        head.attach(model)
    _fails(model, head, ValueError, r"\[7\]", input_ids=prompt(4))


def test_eagle3_aux_layers_not_three_indices():
    shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    em.Eagle3Config(**shape, aux_layers=(1, 2, 3))
    with pytest.raises(ValueError, match=r"\(1, 2\)"):
        em.Eagle3Config(**shape, aux_layers=(1, 2))
    with pytest.raises(ValueError, match=r"\(1, 2, -1\)"):
        em.Eagle3Config(**shape, aux_layers=(1, 2, -1))


@pytest.mark.compat
def test_head_config_of_the_wrong_kind():
    shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    eagle, eagle3 = em.EagleConfig(**shape), em.Eagle3Config(**shape)
    with pytest.raises(TypeError, match="EagleHead.*Eagle3Config"):
        em.EagleHead(eagle3)
    with pytest.raises(TypeError, match="Eagle3Head.*EagleConfig"):
        em.Eagle3Head(eagle)
    with pytest.raises(TypeError, match="dict"):
        em.EagleHead(shape)


def _tiny_mllama():
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=96, cross_attention_layers=[1], pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_global_layers=1, attention_heads=2,
                  image_size=28, patch_size=14, vision_output_dim=32, intermediate_layers_indices=[0])
    torch.manual_seed(0)
    return tf.MllamaForConditionalGeneration(tf.MllamaConfig(text_config=text, vision_config=vision)).eval()


@pytest.mark.compat
def test_unsupported_vlm_family_lists_the_supported_ones(model):
    mllama = _tiny_mllama()
    families = sorted(SUPPORTED_VLMS)
    assert len(families) >= 2
    listed = "".join(rf"(?=.*'{f}')" for f in families)
    for call in (lambda: resolve_target(mllama), lambda: em.Eagle3Head.from_target(mllama),
                 lambda: em.EagleHead.from_target(model).attach(mllama)):
        with pytest.raises(ValueError, match=rf"(?s)(?=.*mllama){listed}"):
            call()
    head = em.EagleHead.from_target(model)
    _fails(mllama, head, ValueError, rf"(?s)(?=.*mllama){listed}", input_ids=prompt(4))


def test_not_a_hugging_face_model(head):
    with pytest.raises(TypeError, match="Linear"):
        head.attach(torch.nn.Linear(2, 2))


# ---- failures after the hooks are in place ---------------------------------------------------------
def test_failure_inside_the_target_forward_leaves_no_hooks(model, head, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the final norm failed")

    monkeypatch.setattr(resolve_target(model).text_model.norm, "forward", broken)  # fails during the prefill
    _fails(model, head, RuntimeError, "the final norm failed", input_ids=prompt(5))


class _BrokenHead:
    """A real head whose ``calls``-th draft step raises, to fail in the middle of the decode loop."""

    def __init__(self, head, calls: int):
        self._head, self.left = head, calls

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def step(self, *args):
        self.left -= 1
        if self.left <= 0:
            raise RuntimeError("draft step failed")
        return self._head.step(*args)


@pytest.mark.compat
@pytest.mark.parametrize("calls", [1, 3])
def test_failure_inside_the_decode_loop_leaves_no_hooks(model, head, calls):
    broken = _BrokenHead(head, calls)
    _fails(model, broken, RuntimeError, "draft step failed", input_ids=prompt(6), max_new_tokens=20,
           tree=em.TreeConfig.chain(2))
    assert broken.left <= 0  # it did fail where intended
    # And the target still decodes normally afterwards.
    ids = prompt(6)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=3, tree=em.TreeConfig.chain(2))
    assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False))
