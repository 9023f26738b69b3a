"""Head checkpoints: official EAGLE / EAGLE-3 layouts in, our layout out, bit-exact; errors name the bad value."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_mm.config import Eagle3Config, EagleConfig
from eagle_mm.heads import Eagle3Head, EagleHead
from eagle_mm.heads.io import load_config, load_head

H, I, NH, NKV, V, DRAFT_V, N_LAYERS = 64, 128, 4, 2, 128, 64, 6
HD = H // NH


def _target(vocab=V, hidden=H, layers=N_LAYERS, dtype=torch.float32):
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=I, num_hidden_layers=layers, num_attention_heads=NH,
        num_key_value_heads=NKV, vocab_size=vocab,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="module")
def target():
    return _target()


# ---- official layouts, built by hand: field names of the released configs, tiny random values --------
def _llama_fields(**extra):
    """The field set of yuhuili/EAGLE-LLaMA3-Instruct-8B and EAGLE3-LLaMA3.1-Instruct-8B config.json."""
    d = {
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": 1,
        "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.28.1", "use_cache": True, "vocab_size": V,
    }
    d.update(extra)
    return d


def _rand(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


def _attn_mlp(prefix, in_dim):
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(NH * HD, in_dim),
        f"{prefix}.self_attn.k_proj.weight": _rand(NKV * HD, in_dim),
        f"{prefix}.self_attn.v_proj.weight": _rand(NKV * HD, in_dim),
        f"{prefix}.self_attn.o_proj.weight": _rand(H, NH * HD),
        f"{prefix}.mlp.gate_proj.weight": _rand(I, H),
        f"{prefix}.mlp.up_proj.weight": _rand(I, H),
        f"{prefix}.mlp.down_proj.weight": _rand(H, I),
        f"{prefix}.post_attention_layernorm.weight": _rand(H),
    }


def eagle1_official(bias_field=True):
    """EAGLE-1 (LLaMA3-Instruct-8B layout): llama config + rope_theta + bias; fc with bias; embed_tokens included."""
    torch.manual_seed(1)
    extra = {"rope_theta": 500000.0, "rope_scaling": None, "pretraining_tp": 1}
    if bias_field:
        extra["bias"] = True
    config = _llama_fields(**extra)
    weights = {"fc.weight": _rand(H, 2 * H), "fc.bias": _rand(H), **_attn_mlp("layers.0", H), "embed_tokens.weight": _rand(V, H)}
    return config, weights


def eagle3_official(with_embed=False, with_aux=False):
    """EAGLE-3 (LLaMA3.1-Instruct-8B layout): Eagle3 architecture, draft_vocab_size, d2t int64 offsets, t2d bool."""
    torch.manual_seed(2)
    config = _llama_fields(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_V)
    if with_aux:
        config["target_hidden_size"] = H
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    ids = torch.randperm(V)[:DRAFT_V].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    weights = {
        "fc.weight": _rand(H, 3 * H),
        **_attn_mlp("midlayer", 2 * H),
        "midlayer.hidden_norm.weight": _rand(H),
        "midlayer.input_layernorm.weight": _rand(H),
        "norm.weight": _rand(H),
        "lm_head.weight": _rand(DRAFT_V, H),
        "d2t": ids - torch.arange(DRAFT_V),
        "t2d": t2d,
    }
    if with_embed:
        weights["embed_tokens.weight"] = _rand(V, H)
    return config, weights


def write_ckpt(path, config, weights, fmt="safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(weights, str(path / "model.safetensors"))
    elif fmt == "bin":
        torch.save(weights, path / "pytorch_model.bin")
    elif fmt == "sharded":
        keys = sorted(weights)
        halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for name, part in halves.items():
            save_file({k: weights[k] for k in part}, str(path / name))
        index = {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _assert_saved_exactly(saved_dir, expected, target):
    """The saved safetensors equal `expected` bit for bit and hold nothing of the target."""
    saved = load_file(str(saved_dir / "model.safetensors"))
    assert set(saved) == set(expected)
    for k, v in expected.items():
        assert saved[k].dtype == v.dtype, k
        assert torch.equal(saved[k], v), k
    # EAGLE-3's own draft-vocab lm_head has the official name "lm_head.weight", like the target's; it is
    # told apart by shape and value below. No other target key may appear.
    assert not (set(saved) & set(target.state_dict())) - {"lm_head.weight"}
    if "lm_head.weight" in saved:
        assert saved["lm_head.weight"].shape == (DRAFT_V, H) != target.get_output_embeddings().weight.shape
    assert not any("embed_tokens" in k for k in saved)
    for big in (target.get_input_embeddings().weight, target.get_output_embeddings().weight):
        assert not any(t.shape == big.shape and torch.equal(t.to(big.dtype), big) for t in saved.values())


# ---- official checkpoints load, keep their tensors, and round-trip bit-exactly ----------------------
@pytest.mark.compat
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_official_eagle1_loads_and_round_trips(tmp_path, target, fmt):
    config, weights = eagle1_official()
    src = write_ckpt(tmp_path / "src", config, weights, fmt)
    head = load_head(src, target=target)
    assert isinstance(head, EagleHead)
    assert head.config.bias is True and head.config.rope_theta == 500000.0
    own = {k: v for k, v in weights.items() if k != "embed_tokens.weight"}
    state = head.state_dict()
    assert set(state) == set(own)
    for k, v in own.items():
        assert state[k].dtype == torch.float16 and torch.equal(state[k], v), k

    head.save_pretrained(tmp_path / "out")
    saved_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved_cfg["torch_dtype"] == "float16" and saved_cfg["bias"] is True
    _assert_saved_exactly(tmp_path / "out", own, target)
    again = load_head(tmp_path / "out")
    assert again.config == head.config
    assert all(torch.equal(again.state_dict()[k], v) for k, v in own.items())


@pytest.mark.compat
@pytest.mark.parametrize("fmt", ["safetensors", "sharded"])
def test_official_eagle3_loads_and_round_trips(tmp_path, target, fmt):
    config, weights = eagle3_official(with_embed=True)
    src = write_ckpt(tmp_path / "src", config, weights, fmt)
    head = load_head(src, target=target)
    assert isinstance(head, Eagle3Head)
    cfg = head.config
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.aux_layers) == (DRAFT_V, H, None)
    assert cfg.rope_theta == 10000.0  # the released EAGLE-3 config has none
    own = {k: v for k, v in weights.items() if k != "embed_tokens.weight"}
    state = head.state_dict()
    assert set(state) == set(own)
    for k, v in own.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    # d2t offsets reproduce the draft vocabulary that t2d marks.
    assert torch.equal(head.draft_to_target(torch.arange(DRAFT_V)), weights["t2d"].nonzero().flatten())

    head.save_pretrained(tmp_path / "out")
    _assert_saved_exactly(tmp_path / "out", own, target)
    assert load_config(tmp_path / "out") == cfg


def test_official_eagle3_aux_ids_and_target_hidden_size(tmp_path, target):
    config, weights = eagle3_official(with_aux=True)
    head = load_head(write_ckpt(tmp_path / "src", config, weights), target=target)
    assert head.config.aux_layers == (1, 3, 4)
    head.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["draft_vocab_size"] == DRAFT_V


def test_eagle1_without_bias_field_follows_weights(tmp_path):
    # Vicuna / LLaMA2-chat EAGLE configs carry no "bias"; the official loader defaults to True.
    config, weights = eagle1_official(bias_field=False)
    assert isinstance(load_config(write_ckpt(tmp_path / "a", config, weights)), EagleConfig)
    assert load_head(tmp_path / "a").config.bias is True
    weights.pop("fc.bias")
    assert load_head(write_ckpt(tmp_path / "b", config, weights)).config.bias is False


def test_config_only_kind_detection(tmp_path):
    # The official EAGLE-3 training config keeps the LlamaForCausalLM architecture; draft_vocab_size marks it.
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "config.json").write_text(json.dumps(_llama_fields(draft_vocab_size=DRAFT_V)))
    assert isinstance(load_config(tmp_path / "e3"), Eagle3Config)
    (tmp_path / "e1").mkdir()
    (tmp_path / "e1" / "config.json").write_text(json.dumps(_llama_fields(bias=False, rope_theta=500000.0)))
    cfg = load_config(tmp_path / "e1")
    assert isinstance(cfg, EagleConfig) and cfg.bias is False and cfg.rope_theta == 500000.0


def test_legacy_inv_freq_is_ignored(tmp_path):
    config, weights = eagle1_official()
    weights["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(HD // 2)
    head = load_head(write_ckpt(tmp_path, config, weights, "bin"))
    assert "layers.0.self_attn.rotary_emb.inv_freq" not in head.state_dict()


# ---- our own heads ----------------------------------------------------------------------------------
@pytest.mark.compat
def test_from_target_eagle3_round_trip_is_bit_exact(tmp_path, target):
    torch.manual_seed(3)
    head = Eagle3Head.from_target(target, draft_vocab_size=DRAFT_V)
    head.set_draft_vocab(torch.randperm(V)[:DRAFT_V])
    head.save_pretrained(tmp_path)
    again = load_head(tmp_path, target=target)
    assert type(again) is Eagle3Head and again.config == head.config
    for k, v in head.state_dict().items():
        assert again.state_dict()[k].dtype == v.dtype and torch.equal(again.state_dict()[k], v), k

    B, Q = 1, 3
    embeds, hidden = torch.randn(B, Q, H), torch.randn(B, Q, 3 * H)
    pos = torch.arange(Q)[None]
    mask = torch.full((Q, Q), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out_a = head.step(embeds, head.fuse(hidden), pos, mask, None)
        out_b = again.step(embeds, again.fuse(hidden), pos, mask, None)
    assert torch.equal(out_a[1], out_b[1])


def test_bf16_round_trip_keeps_dtype(tmp_path):
    target = _target(dtype=torch.bfloat16)
    head = EagleHead.from_target(target)
    head.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = load_head(tmp_path, target=target)
    assert next(again.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(again.state_dict()[k], v) for k, v in head.state_dict().items())
    assert next(load_head(tmp_path, dtype=torch.float32).parameters()).dtype == torch.float32
    assert next(load_head(tmp_path, dtype="float16").parameters()).dtype == torch.float16


def test_save_bin_replaces_stale_safetensors(tmp_path, target):
    head = EagleHead.from_target(target)
    head.save_pretrained(tmp_path)
    torch.manual_seed(4)
    other = EagleHead.from_target(target)
    other.save_pretrained(tmp_path, safe_serialization=False)
    assert not (tmp_path / "model.safetensors").exists()
    assert torch.equal(load_head(tmp_path).fc.weight, other.fc.weight)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_from_pretrained_checks_the_class(tmp_path, target):
    EagleHead.from_target(target).save_pretrained(tmp_path)
    assert isinstance(EagleHead.from_pretrained(tmp_path), EagleHead)
    with pytest.raises(ValueError, match="EagleHead checkpoint, not a Eagle3Head"):
        Eagle3Head.from_pretrained(tmp_path)


# ---- errors name the offending value ----------------------------------------------------------------
def test_hidden_size_mismatch_with_target(tmp_path, target):
    EagleHead.from_target(target).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"hidden_size 64 .*width 32"):
        load_head(tmp_path, target=_target(hidden=32))


def test_vocab_mismatch_with_target(tmp_path, target):
    Eagle3Head.from_target(target, draft_vocab_size=DRAFT_V).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"vocab_size 128 .* 256"):
        load_head(tmp_path, target=_target(vocab=256))


def test_official_embed_tokens_must_match_target(tmp_path):
    config, weights = eagle1_official()
    src = write_ckpt(tmp_path, config, weights)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight .*\(128, 64\).*\(256, 64\)"):
        load_head(src, target=_target(vocab=256))


def test_aux_layer_out_of_range(tmp_path, target):
    cfg = Eagle3Config(
        hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV, vocab_size=V,
        draft_vocab_size=DRAFT_V, aux_layers=(2, 3, 99),
    )
    Eagle3Head(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"aux layer index \[99\] out of range"):
        load_head(tmp_path, target=target)


def test_unknown_weight_layout(tmp_path):
    config, _ = eagle1_official()
    weights = {"model.layers.0.self_attn.q_proj.weight": _rand(H, H), "lm_head.weight": _rand(V, H)}
    with pytest.raises(ValueError, match=r"unknown weight layout.*model\.layers\.0\.self_attn\.q_proj\.weight"):
        load_head(write_ckpt(tmp_path, config, weights))


def test_eagle3_config_with_eagle1_weights(tmp_path):
    config, _ = eagle3_official()
    _, weights = eagle1_official()
    with pytest.raises(ValueError, match=r"EAGLE-3 head .*draft_vocab_size=64.*EAGLE-1 layout"):
        load_head(write_ckpt(tmp_path, config, weights))


def test_missing_weight_keys(tmp_path):
    config, weights = eagle3_official()
    del weights["midlayer.mlp.down_proj.weight"], weights["d2t"]
    with pytest.raises(ValueError, match=r"lacks 2 weight\(s\).*'d2t'.*'midlayer\.mlp\.down_proj\.weight'"):
        load_head(write_ckpt(tmp_path, config, weights))


def test_unexpected_keys_strict_and_lenient(tmp_path):
    config, weights = eagle1_official()
    weights["layers.0.input_layernorm.weight"] = _rand(H)
    src = write_ckpt(tmp_path, config, weights)
    with pytest.raises(ValueError, match=r"layers\.0\.input_layernorm\.weight"):
        load_head(src)
    assert "layers.0.input_layernorm.weight" not in load_head(src, strict=False).state_dict()


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    config, weights = eagle1_official()
    weights["fc.weight"] = _rand(H, 3 * H)
    with pytest.raises(ValueError, match=r"fc\.weight: checkpoint \(64, 192\) vs head \(64, 128\)"):
        load_head(write_ckpt(tmp_path, config, weights))


def test_d2t_out_of_vocab(tmp_path):
    config, weights = eagle3_official()
    weights["d2t"] = weights["d2t"] + V
    with pytest.raises(ValueError, match=r"d2t maps .* outside the target vocabulary \[0, 128\)"):
        load_head(write_ckpt(tmp_path, config, weights))


def test_multi_layer_llama_config_is_not_a_head(tmp_path):
    LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=N_LAYERS, num_attention_heads=NH).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"not an EAGLE/EAGLE-3 head config: num_hidden_layers=6"):
        load_config(tmp_path)


def test_non_llama_model_type_is_not_a_head(tmp_path):
    config, weights = eagle1_official()
    config["model_type"] = "gpt2"
    with pytest.raises(ValueError, match=r"not an EAGLE/EAGLE-3 head config: model_type 'gpt2'"):
        load_head(write_ckpt(tmp_path, config, weights))


def test_missing_directory_config_and_weights(tmp_path):
    gone = tmp_path / "no_such_head"
    with pytest.raises(FileNotFoundError, match=re.escape(str(gone))):
        load_head(gone)
    gone.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no_such_head has no config\.json"):
        load_head(gone)
    config, _ = eagle1_official()
    (gone / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=r"no weights in .*no_such_head.*model\.safetensors"):
        load_head(gone)


def test_bad_dtype_argument(tmp_path, target):
    EagleHead.from_target(target).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"floating torch dtype.*'int8'"):
        load_head(tmp_path, dtype="int8")


# ---- checksums: what this library saved is what it loads ---------------------------------------------
def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a weight's bytes: the file's header and index stay valid
    path.write_bytes(bytes(data))


@pytest.mark.compat
@pytest.mark.parametrize("name, safe", [("model.safetensors", True), ("pytorch_model.bin", False)])
def test_a_flipped_byte_in_a_saved_head_is_refused(tmp_path, target, name, safe):
    head = Eagle3Head.from_target(target, draft_vocab_size=DRAFT_V, aux_layers=(1, 3, 4))
    head.save_pretrained(tmp_path / "head", safe_serialization=safe)
    recorded = json.loads((tmp_path / "head" / "config.json").read_text())["eagle_mm_weights_sha256"]
    assert list(recorded) == [name]
    load_head(tmp_path / "head")  # intact: loads
    _flip_a_byte(tmp_path / "head" / name)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'head' / name} is damaged: its bytes changed "
                                                   "after it was written")) as err:
        load_head(tmp_path / "head")
    assert "copy or save the head again" in str(err.value) and "eagle_mm_weights_sha256" in str(err.value)


def test_a_head_saved_elsewhere_loads_without_a_checksum(tmp_path, target):
    head = EagleHead.from_target(target)
    head.save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    del config["eagle_mm_weights_sha256"]
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    _flip_a_byte(tmp_path / "head" / "model.safetensors")  # undetectable without a record, as before
    load_head(tmp_path / "head")


def test_weights_a_checksum_does_not_cover_are_refused(tmp_path, target):
    head = EagleHead.from_target(target)
    head.save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["eagle_mm_weights_sha256"] = {"pytorch_model.bin": "0" * 64}
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model.safetensors is not among the files .* records"):
        load_head(tmp_path / "head")
