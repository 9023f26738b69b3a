"""What the draft head sees of the images, and the errors for image inputs that do not fit the prompt."""
from __future__ import annotations

import pytest
import torch

import eagle_mm as em
from tests.test_multimodal_tiny import (END, FAMILIES, IMG, START, VISION_HIDDEN, compat_params, deepstack_added,
                                        head_for, needs_working_forward, picture, tiny_vlm)
from tests.test_multimodal_tiny import one_thread  # noqa: F401  (autouse: one torch thread in this module)
from tests.tiny import prompt, tiny_model


class _Recording:
    """A real head that records the inputs and outputs of each step."""

    def __init__(self, head):
        self._head, self.calls, self.features = head, [], []

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def fuse(self, features):
        self.features.append(features)
        return self._head.fuse(features)

    def step(self, embeds, hidden, position_ids, mask, past):
        out = self._head.step(embeds, hidden, position_ids, mask, past)
        self.calls.append((embeds, out[0], out[1]))
        return out


def _prefill_step(tiny, head, inputs):
    """(embeds, out, logits) of the head's prefill step (its first), over the whole prompt."""
    rec = _Recording(head)
    em.speculative_generate(tiny.model, rec, **inputs, max_new_tokens=1)
    return rec.calls[0]


@pytest.mark.parametrize("family", compat_params("llava"))
def test_draft_sees_the_image_features(family):
    """At image positions the head's token embedding is the target's merged input (the image feature), and what
    it proposes right after the image changes with the image, with the same head and text."""
    needs_working_forward(family)
    tiny = tiny_vlm(family)
    model = tiny.model
    head = head_for("eagle3", model)
    rows = [[[5, 6, 7], "img", [8, 9]]]
    a, b = tiny.inputs(rows, [picture(10)]), tiny.inputs(rows, [picture(11)])
    ids = a["input_ids"][0]
    first = int((ids == IMG).nonzero()[0])  # first image position
    with torch.no_grad():
        merged = model(**a, output_hidden_states=True).hidden_states[0]  # HF's layer-0 input: (1, T, H)
    emb_a, out_a, logits_a = _prefill_step(tiny, head, a)
    emb_b, out_b, logits_b = _prefill_step(tiny, head, b)
    # Entry t pairs feature t with the embedding of token t+1; the last one is the root's own embedding.
    torch.testing.assert_close(emb_a[:, :-1], merged[:, 1:].to(emb_a.dtype), rtol=0, atol=0)
    placeholder = head.embed(torch.tensor([[IMG]]))[0, 0]
    assert not torch.allclose(emb_a[0, first - 1], placeholder)
    text = ids != IMG
    assert torch.equal(emb_a[0, :-1][text[1:]], emb_b[0, :-1][text[1:]])  # text embeddings do not move
    # Entry first-1 pairs a text-only feature (causal: it has not seen the image) with the first image position:
    # only the embedding can carry the image there.
    assert not torch.allclose(out_a[0, first - 1], out_b[0, first - 1])
    assert torch.equal(out_a[0, : first - 1], out_b[0, : first - 1])
    assert not torch.allclose(logits_a[0, -1], logits_b[0, -1])  # the root's proposals
    same = _prefill_step(tiny, head, tiny.inputs(rows, [picture(10)]))
    assert torch.equal(same[2], logits_a)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_head_reads_features_after_the_deepstack_addition(family):
    """The EAGLE-3 features the head gets at the prefill are the inputs of the aux layers: HF's hidden_states plus
    Qwen3-VL's deepstack image features at the image positions (of the tiny target's default aux layers 1, 2, 3,
    the first two follow a deepstack layer)."""
    tiny = tiny_vlm(family)
    inputs = tiny.inputs([[[5, 6, 7], "img", [8, 9]]], [picture(10)])
    rec = _Recording(head_for("eagle3", tiny.model))
    em.speculative_generate(tiny.model, rec, **inputs, max_new_tokens=1)
    with torch.no_grad():
        hf = tiny.model(**inputs, output_hidden_states=True).hidden_states
    layers = rec.feature_layers(len(hf) - 1)
    assert layers == (1, 2, 3)
    expected = deepstack_added(tiny, inputs, hf)
    torch.testing.assert_close(rec.features[0], torch.cat([expected[i] for i in layers], -1), rtol=0, atol=0)
    image = inputs["input_ids"] == IMG
    before = torch.cat([hf[i] for i in layers], -1)
    assert torch.equal(rec.features[0][~image], before[~image]) and not torch.allclose(rec.features[0][image],
                                                                                         before[image])


@pytest.mark.parametrize("family", FAMILIES)
def test_images_are_encoded_once_and_later_forwards_are_text_only(family):
    needs_working_forward(family)
    tiny = tiny_vlm(family)
    model = tiny.model
    tower = next(m for n, m in model.named_modules() if n.endswith(("vision_tower", "visual", "vision_model")))
    towers, calls = [], []
    h1 = tower.register_forward_hook(lambda *a: towers.append(1))
    h2 = model.register_forward_pre_hook(lambda m, args, kw: calls.append(sorted(k for k, v in kw.items()
                                                                                 if v is not None)), with_kwargs=True)
    inputs = tiny.inputs([[[5], "img", [6]]], [picture(1)])
    try:
        out = em.speculative_generate(model, head_for("eagle3", model), **inputs, max_new_tokens=6,
                                      tree=em.TreeConfig.chain(2), return_dict_in_generate=True)
    finally:
        h1.remove()
        h2.remove()
    assert len(towers) == 1
    assert len(calls) == 1 + out.stats.num_target_forwards
    image_keys = {"pixel_values", "mm_encoder_outputs", "image_grid_thw", "token_type_ids", "mm_token_type_ids"}
    assert image_keys & set(calls[0])
    for later in calls[1:]:
        assert set(later) == {"input_ids", "attention_mask", "position_ids", "use_cache",
                              "cache" if "cache" in later else "past_key_values"}


def test_text_language_model_heads_do_not_read_input_embeds():
    """Text LMs keep embedding tokens in the head (no layer-0 capture), as before."""
    model = tiny_model("llama")
    rec = _Recording(em.Eagle3Head.from_target(model))
    ids = prompt(6)
    em.speculative_generate(model, rec, input_ids=ids, max_new_tokens=1)
    # The engine prefills a text prompt in a bucket, left-padded with empty slots: the prompt's entries come last.
    torch.testing.assert_close(rec.calls[0][0][:, -ids.shape[1]:-1], rec.embed(ids[:, 1:]), rtol=0, atol=0)


# ---- bad inputs ------------------------------------------------------------------------------------
def _fails(tiny, match, **inputs):
    with pytest.raises(ValueError, match=match):
        em.speculative_generate(tiny.model, head_for("eagle", tiny.model), **inputs, max_new_tokens=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_tokens_and_images_that_do_not_match(family):
    tiny = tiny_vlm(family)
    good = tiny.inputs([[[5], "img", [6]]], [picture(1)])
    ids = good["input_ids"]
    # One placeholder token too few: 3 tokens for an image of 4 features.
    short = torch.cat((ids[:, :2], ids[:, 3:]), 1)
    extra = {k: v[:, :short.shape[1]] if k in ("attention_mask", "mm_token_type_ids", "token_type_ids") else v
             for k, v in good.items() if k != "input_ids"}
    if "mm_token_type_ids" in extra:
        extra["mm_token_type_ids"] = (short == IMG).int()
    if "token_type_ids" in extra:
        extra["token_type_ids"] = (short == IMG).long()
    _fails(tiny, rf"3 image tokens \(id {IMG}\).*1 image\(s\) give 4 image features", input_ids=short, **extra)
    # Two images for one placeholder.
    two = tiny.inputs([[[5], "img", [6], "img"]], [picture(1), picture(2)])
    one = tiny.inputs([[[5], "img", [6]]], [picture(1)])
    pixels = {k: v for k, v in two.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                          "token_type_ids")}
    tokens = {k: v for k, v in one.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                    "token_type_ids")}
    _fails(tiny, r"4 image tokens.*2 image\(s\) give 8 image features", **tokens, **pixels)


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_mismatch_through_the_custom_generate_route(family):
    """model.generate(custom_generate=...) reaches the loop without speculative_generate's early check; on
    transformers >= 5.24 the images arrive there already encoded."""
    tiny = tiny_vlm(family)
    tokens = tiny.inputs([[[5], "img", [6]]], [picture(1)])
    two = tiny.inputs([[[5], "img", "img"]], [picture(1), picture(2)])
    pixels = {k: v for k, v in two.items() if k not in tokens or k == "pixel_values"}
    tokens.pop("pixel_values")
    head = head_for("eagle", tiny.model)
    with pytest.raises(ValueError, match=r"4 image tokens.*2 image\(s\) give 8 image features"):
        tiny.model.generate(**tokens, **pixels, custom_generate=em.custom_generate, head=head, max_new_tokens=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_pixels_without_image_tokens_and_image_tokens_without_pixels(family):
    tiny = tiny_vlm(family)
    with_image = tiny.inputs([[[5], "img", [6]]], [picture(1)])
    pixels = {k: v for k, v in with_image.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                                 "token_type_ids")}
    text = tiny.inputs([[[5, 6, 7, 8]]])
    _fails(tiny, rf"1 image\(s\) were given but input_ids hold no image tokens \(id {IMG}\)", **text, **pixels)
    tokens = {k: v for k, v in with_image.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                           "token_type_ids")}
    _fails(tiny, rf"input_ids hold 4 image tokens \(id {IMG}\) but no images were given", **tokens)


@pytest.mark.parametrize("family", ["llava", "qwen3_vl"])
def test_auto_tree_with_images_asks_for_text_calibration_prompts(family):
    tiny = tiny_vlm(family)
    with pytest.raises(ValueError, match=r"tree='auto' calibrates on text prompts.*autotree_inputs"):
        em.speculative_generate(tiny.model, head_for("eagle3", tiny.model), **tiny.inputs([[[5], "img", [6]]],
                                [picture(1)]), max_new_tokens=2, tree="auto")


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_head_sized_for_the_vision_tower_is_refused(kind):
    model = tiny_vlm("gemma3").model
    shape = dict(hidden_size=VISION_HIDDEN, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 vocab_size=96)
    head = em.EagleHead(em.EagleConfig(**shape)) if kind == "eagle" else em.Eagle3Head(em.Eagle3Config(**shape))
    with pytest.raises(ValueError, match=rf"hidden_size {VISION_HIDDEN}.*64"):
        head.attach(model)
    with pytest.raises(ValueError, match=rf"hidden_size {VISION_HIDDEN}.*64"):
        em.speculative_generate(model, head, **tiny_vlm("gemma3").inputs([[[5, 6]]]), max_new_tokens=2)


def test_llama4_temperature_tuning_limit():
    """Past floor_scale - 1 cache entries Llama 4's NoPE layers scale queries by cache length, not by position."""
    tiny = tiny_vlm("llama4", floor_scale=40)
    inputs = tiny.inputs([[[5, 6, 7, 8, 9, 10]]])
    tree = em.TreeConfig(depth=4, top_k=3, total_tokens=8)
    _fails_with = dict(tree=tree, max_new_tokens=30)
    with pytest.raises(ValueError, match=r"tree of 8 tokens over a cache of 35 reaches past 39.*floor_scale 40"):
        em.speculative_generate(tiny.model, head_for("eagle", tiny.model), **inputs, **_fails_with)


@pytest.mark.compat
def test_llama4_near_the_temperature_limit_still_matches_generate():
    tiny = tiny_vlm("llama4", floor_scale=40)
    needs_working_forward("llama4")
    inputs = tiny.inputs([[[5, 6], "img", [7]]], [picture(3)])
    n = 39 - 8 - inputs["input_ids"].shape[1]  # max_length - 1 + total_tokens + 1 == the limit
    ref = tiny.model.generate(**inputs, max_new_tokens=n, do_sample=False)
    out = em.speculative_generate(tiny.model, head_for("eagle3", tiny.model), **inputs, max_new_tokens=n,
                                  tree=em.TreeConfig(depth=4, top_k=3, total_tokens=8))
    assert torch.equal(out, ref)


def test_text_models_still_refuse_extra_inputs():
    from eagle_mm.decode.options import split_model_inputs

    ids = prompt(5)
    with pytest.raises(ValueError, match=r"does not support the model input\(s\) \['pixel_values'\]"):
        split_model_inputs(ids, {"pixel_values": torch.zeros(1, 3, 28, 28), "mm_encoder_outputs": {}})
    mask, pos, extra = split_model_inputs(ids, {"mm_encoder_outputs": {}, "token_type_ids": None})
    assert extra == {} and torch.equal(pos, torch.arange(5)[None])


def test_videos_are_refused():
    tiny = tiny_vlm("qwen2_5_vl")
    inputs = tiny.inputs([[[5, START, END, 6]]])
    video = torch.zeros(16, 3 * 2 * 14 * 14)
    with pytest.raises(ValueError, match="video"):
        em.speculative_generate(tiny.model, head_for("eagle", tiny.model), **inputs, pixel_values_videos=video,
                                video_grid_thw=torch.tensor([[1, 4, 4]]), max_new_tokens=2)
