"""EAGLE-3 heads published for vision-language targets, in their publishers' layouts.

Each fixture is the publisher's config.json with its field names and values, sized down to the tiny targets
(hidden size, heads, vocabulary, M-RoPE sections), and random weights under the publisher's key names:
SpecForge (SGLang) Qwen2.5-VL and Qwen3-VL heads (SpecForge configs/qwen2-5-vl-eagle3.json,
configs/qwen3-vl-8b-eagle3.json; draft model specforge/modeling/draft/qwen2_5_vl_eagle.py on
llama3_eagle.py) and AngelSlim's Qwen3-VL head (angelslim/compressor/speculative/train/configs/
qwen3-vl-4b-eagle3-mrope.json; draft model train/models/draft/llama_eagle3.py). Both keep the official
EAGLE-3 key names and also save the drafter's own copy of the target embedding (embed_tokens.weight).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import eagle_mm as em
from tests.test_multimodal_tiny import TEXT, V, picture, tiny_vlm
from tests.test_multimodal_tiny import one_thread  # noqa: F401  (autouse: one torch thread in this module)

H, I, NH, NKV, HD = TEXT["hidden_size"], TEXT["intermediate_size"], 4, 2, 16
DRAFT_V = 32
_SIZES = dict(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
              vocab_size=V, draft_vocab_size=DRAFT_V)

SPECFORGE_QWEN2_5_VL = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 2048, "max_window_layers": 28, "model_type": "llama", "num_hidden_layers": 1,
    "rms_norm_eps": 1e-06, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rope_theta": 10000.0,
    "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, **_SIZES,
}
SPECFORGE_QWEN3_VL = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 262144, "model_type": "llama", "target_model_type": "qwen3_vl",
    "num_hidden_layers": 1, "rms_norm_eps": 1e-06, "pretraining_tp": 1,
    "rope_scaling": {"rope_type": "default", "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    "rope_theta": 5000000, "tie_word_embeddings": False, "dtype": "bfloat16", "transformers_version": "4.57.1",
    "use_cache": True, "use_sliding_window": False, **_SIZES,
}
ANGELSLIM_QWEN3_VL = {
    "architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16", "eos_token_id": 151645,
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 262144, "num_hidden_layers": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"type": "default", "rope_type": "default", "mrope_interleaved": True,
                     "mrope_section": [3, 3, 2]},
    "rope_theta": 5000000, "use_cache": True, "tie_word_embeddings": True, "transformers_version": "4.57.1",
    "image_token_id": 151655, "video_token_id": 151656, "vision_end_token_id": 151653,
    "vision_start_token_id": 151652, "modal_type": "VLM", **_SIZES,
}


def _weights(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (DRAFT_V, H), "embed_tokens.weight": (V, H),
        "midlayer.self_attn.q_proj.weight": (NH * HD, 2 * H), "midlayer.self_attn.k_proj.weight": (NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": (NKV * HD, 2 * H), "midlayer.self_attn.o_proj.weight": (H, NH * HD),
        "midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I), "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
    }
    state = {k: (torch.randn(s, generator=gen) * 0.3).to(torch.bfloat16) for k, s in shapes.items()}
    ids = torch.randperm(V, generator=gen)[:DRAFT_V].sort().values
    state["d2t"] = ids - torch.arange(DRAFT_V)
    state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    return state


def _write(path, config: dict, seed: int = 0):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(_weights(seed), path / "model.safetensors")
    return path


def _check_loaded(head, config):
    state = _weights(0)
    assert isinstance(head, em.Eagle3Head) and head.config.draft_vocab_size == DRAFT_V
    assert head.config.rope_scaling == config["rope_scaling"] and head.config.rope_theta == config["rope_theta"]
    assert head.fc.weight.shape == (H, 3 * H) and head.lm_head.weight.shape == (DRAFT_V, H)
    own = head.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if k != "embed_tokens.weight")
    assert "embed_tokens.weight" not in own  # the target's embedding is used


@pytest.mark.parametrize("family, config", [("qwen2_5_vl", SPECFORGE_QWEN2_5_VL), ("qwen3_vl", SPECFORGE_QWEN3_VL),
                                            ("qwen3_vl", ANGELSLIM_QWEN3_VL)],
                         ids=["specforge-qwen2.5-vl", "specforge-qwen3-vl", "angelslim-qwen3-vl"])
def test_vlm_head_decodes_losslessly(tmp_path, family, config):
    tiny = tiny_vlm(family)
    model = tiny.model
    head = em.load_head(_write(tmp_path / "head", config), target=model)
    _check_loaded(head, config)
    head = head.float()  # the tiny target is fp32
    for rows, images in (([[[5, 6], "img", [7, 8]]], [picture(1)]), ([[[5, 6, 7, 8, 9]]], [])):
        inputs = tiny.inputs(rows, images)
        ref = model.generate(**inputs, max_new_tokens=10, do_sample=False)
        out = em.speculative_generate(model, head, **inputs, max_new_tokens=10, tree=em.TreeConfig(3, 3, 6))
        assert torch.equal(out, ref)


@pytest.mark.parametrize("config", [SPECFORGE_QWEN3_VL, ANGELSLIM_QWEN3_VL], ids=["specforge", "angelslim"])
def test_qwen3_vl_heads_load_with_their_shapes(tmp_path, config):
    head = em.load_head(_write(tmp_path / "head", config))
    _check_loaded(head, config)
    assert head.feature_layers(8) == (2, 4, 5)  # no aux ids in either config: the defaults
    head.save_pretrained(tmp_path / "again")
    back = em.load_head(tmp_path / "again")
    assert back.config == head.config and all(torch.equal(a, b) for a, b in
                                              zip(back.state_dict().values(), head.state_dict().values()))
