"""Tiny random vision-language targets of the supported families, and what eagle_mm finds in them.

Images go through the family's PIL image processor built from its defaults (Llama 4's needs torchvision,
absent here: its pixels come from Gemma 3's PIL processor, which normalises the same way); input ids are
built by hand with each image's placeholder expanded to its feature count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

import eagle_mm as em
from eagle_mm.hf.parts import SUPPORTED_VLMS, resolve_target

V = 96
IMG, START, END = V - 1, V - 2, V - 3  # image placeholder, begin- and end-of-image tokens
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=V, max_position_embeddings=512, tie_word_embeddings=False)
VISION_HIDDEN = 32
FAMILIES = ("llava", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "llama4")
QWEN = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # M-RoPE families: 3D positions, image_grid_thw


def _llava():
    vision = dict(model_type="clip_vision_model", hidden_size=VISION_HIDDEN, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    cfg = tf.LlavaConfig(text_config=dict(TEXT, model_type="llama"), vision_config=vision, image_token_index=IMG,
                         image_seq_length=4)
    proc = tf.LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return cfg, tf.LlavaForConditionalGeneration, proc


def _qwen2_5_vl():
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(depth=1, hidden_size=VISION_HIDDEN, intermediate_size=64, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    cfg = tf.Qwen2_5_VLConfig(text_config=dict(TEXT, model_type="qwen2_5_vl_text", head_dim=16, rope_parameters=rope,
                                               eos_token_id=None, bos_token_id=None),
                              vision_config=vision, image_token_id=IMG, video_token_id=V - 4,
                              vision_start_token_id=START, vision_end_token_id=END)
    # 56x56 images give a 4x4 patch grid = 4 tokens after the 2x2 merge; 56x112 ones give 8.
    proc = tf.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 112)
    return cfg, tf.Qwen2_5_VLForConditionalGeneration, proc


def _qwen3_vl(moe: bool = False):
    # Interleaved M-RoPE; the two vision blocks' deepstack features are added to the outputs of text layers 0 and 1.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    vision = dict(depth=2, hidden_size=VISION_HIDDEN, intermediate_size=64, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    text = dict(TEXT, head_dim=16, rope_parameters=rope)
    tokens = dict(image_token_id=IMG, video_token_id=V - 4, vision_start_token_id=START, vision_end_token_id=END)
    # 56x56 images are resized to 64x64: a 4x4 patch grid = 4 tokens after the 2x2 merge; 56x112 ones give 8.
    proc = tf.Qwen2VLImageProcessorPil(patch_size=16, min_pixels=64 * 64, max_pixels=64 * 128)
    if moe:  # MoE on layers 1 and 3
        text.update(model_type="qwen3_vl_moe_text", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    decoder_sparse_step=2)
        cfg = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **tokens)
        return cfg, tf.Qwen3VLMoeForConditionalGeneration, proc
    cfg = tf.Qwen3VLConfig(text_config=dict(text, model_type="qwen3_vl_text"), vision_config=vision, **tokens)
    return cfg, tf.Qwen3VLForConditionalGeneration, proc


def _gemma3():
    text = dict(TEXT, model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                num_hidden_layers=6)
    vision = dict(model_type="siglip_vision_model", hidden_size=VISION_HIDDEN, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMG,
                          boi_token_index=START, eoi_token_index=END)
    return cfg, tf.Gemma3ForConditionalGeneration, tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


def _llama4():
    # Layers alternate chunked RoPE attention (chunk 6) and full NoPE attention; MoE on layers 1 and 3.
    text = dict(TEXT, head_dim=16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=6, pad_token_id=0)
    vision = dict(hidden_size=VISION_HIDDEN, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  image_size=56, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=32,
                  projector_output_dim=32, vision_output_dim=32)
    cfg = tf.Llama4Config(text_config=text, vision_config=vision, image_token_index=IMG, boi_token_index=START,
                          eoi_token_index=END)
    return cfg, tf.Llama4ForConditionalGeneration, tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


_BUILDERS = {"llava": _llava, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl,
             "qwen3_vl_moe": functools.partial(_qwen3_vl, moe=True), "gemma3": _gemma3, "llama4": _llama4}


@dataclass
class TinyVLM:
    family: str
    model: object
    processor: object

    def inputs(self, rows: list[list], images: list[Image.Image] | None = None) -> dict:
        """Model inputs for a batch: each row a list of text-token lists and "img" markers (one image each, in
        order from ``images``); rows are left-padded."""
        images = list(images or [])
        pix = self.processor(images, return_tensors="pt") if images else {}
        pix = {k: v for k, v in pix.items() if k != "num_crops"}
        per_image = self._tokens_per_image(pix, len(images))
        seqs, k = [], 0
        for row in rows:
            ids = []
            for seg in row:
                if seg == "img":
                    ids += self._placeholder(per_image[k])
                    k += 1
                else:
                    ids += list(seg)
            seqs.append(ids)
        width = max(len(s) for s in seqs)
        input_ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        out = dict(input_ids=input_ids, attention_mask=mask, **pix)
        if self.family in QWEN:
            out["mm_token_type_ids"] = (input_ids == IMG).int()
        if self.family == "gemma3":
            out["token_type_ids"] = (input_ids == IMG).long()
        return out

    def _tokens_per_image(self, pix: dict, n: int) -> list[int]:
        if self.family in QWEN:
            return (pix["image_grid_thw"].prod(-1) // 4).tolist() if n else []
        return [4] * n

    def _placeholder(self, n: int) -> list[int]:
        return [IMG] * n if self.family == "llava" else [START] + [IMG] * n + [END]


@functools.lru_cache(maxsize=None)
def tiny_vlm(family: str, **overrides) -> TinyVLM:
    cfg, cls, proc = _BUILDERS[family]()
    for k, v in overrides.items():
        setattr(cfg.get_text_config(), k, v)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # sharpen random-init logits so greedy choices are far from ties (as tests/tiny.py)
        model.get_output_embeddings().weight.mul_(8.0)
        for name, p in model.named_parameters():  # Gemma 3 initialises its image projection to zeros
            if "multi_modal_projector" in name and not p.any():
                p.normal_(0.0, 0.2)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return TinyVLM(family, model, proc)


def picture(seed: int, size=(56, 56)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


@functools.lru_cache(maxsize=None)
def _forward_works(family: str) -> bool:
    tiny = tiny_vlm(family)
    try:
        with torch.no_grad():
            tiny.model(**tiny.inputs([[[5], "img"]], [picture(0)]))
    except AttributeError:
        return False
    return True


def needs_working_forward(family: str) -> None:
    """transformers 5.24's Llama4ForConditionalGeneration.forward raises AttributeError ('image_outputs' on the
    language model's output) on every call, so neither generate() nor we can run it there."""
    if not _forward_works(family):
        pytest.skip(f"{family}: this transformers release ({tf.__version__}) cannot run the target's forward")


def compat_params(*compat: str) -> list:
    """FAMILIES as pytest params, those named in ``compat`` marked for the transformers 5.17 job."""
    return [pytest.param(f, marks=pytest.mark.compat) if f in compat else f for f in FAMILIES]


def head_for(kind: str, model):
    return em.EagleHead.from_target(model) if kind == "eagle" else em.Eagle3Head.from_target(model)


# ---- what eagle_mm finds in each family -------------------------------------------------------------
def test_every_supported_family_has_a_tiny_model():
    assert sorted(FAMILIES) == sorted(SUPPORTED_VLMS)


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_are_the_language_model(family):
    model = tiny_vlm(family).model
    parts = resolve_target(model)
    tc = model.config.get_text_config()
    assert parts.is_vlm and parts.image_token_id == IMG
    assert parts.text_config is tc and parts.num_layers == tc.num_hidden_layers
    assert type(parts.text_model).__name__.endswith(("TextModel", "LlamaModel"))
    assert parts.embed is model.get_input_embeddings() and parts.lm_head is model.get_output_embeddings()
    assert parts.rope == ("mrope" if family in QWEN else "default")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_head_from_target_is_sized_for_the_language_model(family, kind):
    model = tiny_vlm(family).model
    head = head_for(kind, model)
    tc = model.config.get_text_config()
    assert head.config.hidden_size == tc.hidden_size != VISION_HIDDEN
    assert head.config.vocab_size == tc.vocab_size
    if kind == "eagle3":
        assert head.config.target_hidden_size == tc.hidden_size
        assert head.fc.in_features == 3 * tc.hidden_size
        assert all(0 <= i <= tc.num_hidden_layers for i in head.feature_layers(tc.num_hidden_layers))


def deepstack_added(tiny, inputs, hidden_states: tuple) -> tuple:
    """HF's hidden_states with Qwen3-VL's deepstack image features added where the model adds them: to the output
    of text layer i at the image positions, for the first len(deepstack) layers. HF records each layer's output
    before that addition; the next layer reads it after."""
    image = inputs["input_ids"] == IMG  # (B, T)
    with torch.no_grad():
        deep = tiny.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    out = list(hidden_states)
    for i, feats in enumerate(deep.deepstack_features):  # per layer: (features, H), split per image from 5.24 on
        feats = torch.cat(feats) if isinstance(feats, (list, tuple)) else feats
        out[i + 1] = out[i + 1].clone()
        out[i + 1][image] = out[i + 1][image] + feats
    return tuple(out)


@pytest.mark.parametrize("family", compat_params("qwen3_vl"))
def test_features_are_what_each_decoder_layer_reads(family):
    """Every index, 0 (the merged text + image embeddings) to N, equals HF's hidden_states of a forward with an
    image, except that Qwen3-VL's features hold its deepstack image features (the input of the next layer, as
    vLLM captures them); input_embeds=True keeps index 0 apart."""
    from eagle_mm.hf.features import FeatureCapture

    needs_working_forward(family)
    tiny = tiny_vlm(family)
    inputs = tiny.inputs([[[5, 6], "img", [7]]], [picture(2)])
    parts = resolve_target(tiny.model)
    n, h = parts.num_layers, parts.hidden_size
    with torch.no_grad():
        ref = tiny.model(**inputs, output_hidden_states=True).hidden_states
        if family.startswith("qwen3_vl"):
            hf, ref = ref, deepstack_added(tiny, inputs, ref)
            assert [torch.equal(a, b) for a, b in zip(hf, ref)] == [True, False, False] + [True] * (n - 2)
        with FeatureCapture(parts, tuple(range(n + 1)), input_embeds=True) as cap:
            tiny.model(**inputs)
            embeds, feats = cap.input_embeds(), cap.features()
    image = inputs["input_ids"][0] == IMG
    assert not torch.allclose(embeds[0, image], parts.embed(inputs["input_ids"])[0, image])
    torch.testing.assert_close(embeds, ref[0], rtol=0, atol=0)
    for i, got in enumerate(feats.split(h, dim=-1)):
        torch.testing.assert_close(got, ref[i], rtol=0, atol=0, msg=f"{family} hidden_states[{i}]")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models spend their forwards in small kernels: on a busy 2-core machine two OpenMP threads make them
    several times slower than one (measured: 51 ms vs 7 ms per tiny Gemma 3 forward)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
