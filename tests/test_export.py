"""export_head / load_exported / serving_command / `eagle-mm export`: the files each engine's loader reads.

The expected configs, keys, shapes and dtypes below are data read off the engines' loaders (source
paths in the comments, details in docs/serving.md); round trips through every layout are bit-exact.
"""
import argparse
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle_mm import Eagle3Head, EagleHead, TreeConfig
from eagle_mm.cli.export import add_export_parser, run_export
from eagle_mm.export import LAYOUTS, detect_layout, export_head, load_exported, serving_command
from eagle_mm.heads.io import load_head
from tiny import tiny_model

H, I, NH, NKV, HD, V, N_LAYERS = 64, 96, 4, 2, 16, 96, 6  # tests/tiny.py's llama
DRAFT_V = 32
AUX = (1, 3, 4)  # HF hidden_states indices; custom, not the default (2, N//2, N-3)
KINDS = ("eagle", "eagle3")


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def make_head(kind, target, **overrides):
    """A bf16 head of ``kind`` attached to ``target``; EAGLE-3 with a reduced, permuted draft vocab."""
    if kind == "eagle":
        head = EagleHead.from_target(target, **{"bias": False, **overrides})
    else:
        head = Eagle3Head.from_target(target, aux_layers=AUX, draft_vocab_size=DRAFT_V, **overrides)
        head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:DRAFT_V])
    torch.manual_seed(4)
    with torch.no_grad():  # random norms too, so a swapped or dropped tensor shows
        for p in head.parameters():
            p.normal_()
    return head.to(torch.bfloat16)


# ---- what the loaders read -------------------------------------------------------------------------
_ATTN_MLP = {
    "self_attn.o_proj.weight": (H, NH * HD),
    "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
    "post_attention_layernorm.weight": (H,),
}
# Official EAGLE-1 keys, no "model." prefix. vllm/model_executor/models/llama_eagle.py
# (EagleLlamaForCausalLM.load_weights prepends "model." to all but lm_head; fc has no bias) and
# python/sglang/srt/models/llama_eagle.py (same prefixing; its fc = nn.Linear(2H, H) always has a bias).
EAGLE1_KEYS = {
    "fc.weight": (H, 2 * H),
    "layers.0.self_attn.q_proj.weight": (NH * HD, H),
    "layers.0.self_attn.k_proj.weight": (NKV * HD, H),
    "layers.0.self_attn.v_proj.weight": (NKV * HD, H),
    **{f"layers.0.{k}": s for k, s in _ATTN_MLP.items()},
}
# Official EAGLE-3 keys. vllm/model_executor/models/llama_eagle3.py (midlayer. -> layers.0., "model."
# prefix except lm_head, d2t -> draft_id_to_target_id int64, t2d skipped) and
# python/sglang/srt/models/llama_eagle3.py (name or "model."+name; d2t -> hot_token_id; t2d skipped).
EAGLE3_KEYS = {
    "fc.weight": (H, 3 * H),
    "midlayer.self_attn.q_proj.weight": (NH * HD, 2 * H),
    "midlayer.self_attn.k_proj.weight": (NKV * HD, 2 * H),
    "midlayer.self_attn.v_proj.weight": (NKV * HD, 2 * H),
    **{f"midlayer.{k}": s for k, s in _ATTN_MLP.items()},
    "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
    "norm.weight": (H,), "lm_head.weight": (DRAFT_V, H), "d2t": (DRAFT_V,), "t2d": (V,),
}
EXPECTED_KEYS = {
    ("eagle", "eagle"): EAGLE1_KEYS, ("vllm", "eagle"): EAGLE1_KEYS,
    ("sglang", "eagle"): {**EAGLE1_KEYS, "fc.bias": (H,)},  # zeros: our head has bias=False
    ("eagle", "eagle3"): EAGLE3_KEYS, ("vllm", "eagle3"): EAGLE3_KEYS, ("sglang", "eagle3"): EAGLE3_KEYS,
}
# Parameters of the engine modules the keys must land on (after the qkv / gate_up stacking both do).
_E1 = ["model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
       "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
       "model.layers.0.post_attention_layernorm.weight"]
_E3 = ["model.fc.weight", "model.L.self_attn.qkv_proj.weight", "model.L.self_attn.o_proj.weight",
       "model.L.mlp.gate_up_proj.weight", "model.L.mlp.down_proj.weight", "model.L.input_layernorm.weight",
       "model.L.post_attention_layernorm.weight", "model.L.hidden_norm.weight", "model.norm.weight", "lm_head.weight"]
ENGINE_PARAMS = {
    ("vllm", "eagle"): set(_E1),
    ("sglang", "eagle"): set(_E1) | {"model.fc.bias"},
    ("vllm", "eagle3"): {k.replace(".L.", ".layers.0.") for k in _E3} | {"draft_id_to_target_id"},
    ("sglang", "eagle3"): {k.replace(".L.", ".midlayer.") for k in _E3} | {"hot_token_id"},
}
# Config fields each loader reads, with the values it must find. vLLM: vllm/transformers_utils/configs/
# eagle.py (architectures), vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (top-level aux ids),
# llama.py (bias/attention_bias -> attention biases). SGLang: model_runner / eagle_worker (eagle_config),
# llama.py set_eagle3_layers_to_capture (+1 per id), llama_eagle3.py (draft_vocab_size, bias -> fc bias).
_COMMON = {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False,
           "hidden_size": H, "head_dim": HD, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "vocab_size": V, "attention_bias": False}
_E3_FIELDS = {"draft_vocab_size": DRAFT_V, "target_hidden_size": H}
EXPECTED_CONFIG = {
    ("eagle", "eagle"): {**_COMMON, "architectures": ["LlamaForCausalLM"], "bias": False},
    ("vllm", "eagle"): {**_COMMON, "architectures": ["LlamaForCausalLM"], "bias": False},
    ("sglang", "eagle"): {**_COMMON, "architectures": ["LlamaForCausalLMEagle"], "bias": False},
    ("eagle", "eagle3"): {**_COMMON, **_E3_FIELDS, "architectures": ["LlamaForCausalLMEagle3"],
                          "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX)}},
    ("vllm", "eagle3"): {**_COMMON, **_E3_FIELDS, "architectures": ["LlamaForCausalLMEagle3"],
                         "eagle_aux_hidden_state_layer_ids": list(AUX)},
    ("sglang", "eagle3"): {**_COMMON, **_E3_FIELDS, "architectures": ["LlamaForCausalLMEagle3"],
                           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX],
                                            "use_aux_hidden_state": True}},
}
_STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
            ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def engine_param(layout, key):
    """The engine parameter a file key loads into (None: skipped), following the loaders' renames."""
    if key == "t2d":
        return None
    if key == "d2t":
        return "draft_id_to_target_id" if layout == "vllm" else "hot_token_id"
    if layout == "vllm":
        key = key.replace("midlayer.", "layers.0.")
    if "lm_head" not in key:
        key = "model." + key
    for ours, theirs in _STACKED.items():
        key = key.replace(ours, theirs)
    return key


def _files(path):
    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return config, tensors


# ---- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_files_match_what_the_loader_reads(layout, kind, target, tmp_path):
    export_head(make_head(kind, target), tmp_path, layout)
    config, tensors = _files(tmp_path)
    for field, value in EXPECTED_CONFIG[(layout, kind)].items():
        assert config.get(field) == value, f"{layout}/{kind}: config[{field!r}]"
    assert not config.get("bias") or kind == "eagle" and layout == "eagle"  # both engines read it as attention bias
    expected = EXPECTED_KEYS[(layout, kind)]
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    for key, tensor in tensors.items():
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(key, torch.bfloat16)
        assert tensor.dtype == want, f"{key}: {tensor.dtype}"
    if layout != "eagle":
        assert {engine_param(layout, k) for k in tensors} - {None} == ENGINE_PARAMS[(layout, kind)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip_is_exact(layout, kind, target, tmp_path):
    head = make_head(kind, target)
    export_head(head, tmp_path, layout)
    back = load_exported(tmp_path, target=target)
    assert type(back) is type(head) and back.config == head.config
    ours, theirs = head.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert theirs[key].dtype == ours[key].dtype and torch.equal(theirs[key], ours[key]), key
    assert back.inv_freq.dtype == torch.float32
    if kind == "eagle3":
        assert back.feature_layers(N_LAYERS) == AUX


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_target_weights_saved(layout, target, tmp_path):
    for kind in KINDS:
        export_head(make_head(kind, target), tmp_path / kind, layout)
        _, tensors = _files(tmp_path / kind)
        assert not any("embed_tokens" in k for k in tensors)
        for weight in (target.get_input_embeddings().weight, target.get_output_embeddings().weight):
            assert not any(t.shape == weight.shape and torch.equal(t, weight.to(t.dtype)) for t in tensors.values())


def test_vllm_eagle1_is_the_official_layout(target, tmp_path):
    head = make_head("eagle", target)
    export_head(head, tmp_path / "eagle", "eagle")
    export_head(head, tmp_path / "vllm", "vllm")
    (c1, t1), (c2, t2) = _files(tmp_path / "eagle"), _files(tmp_path / "vllm")
    assert {k: v for k, v in c1.items() if k != "eagle_mm_export"} == {k: v for k, v in c2.items() if k != "eagle_mm_export"}
    assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)


@pytest.mark.compat
def test_aux_layers_convert_per_engine(target, tmp_path):
    head = make_head("eagle3", target)
    for layout in LAYOUTS:
        export_head(head, tmp_path / layout, layout)
    sglang = json.loads((tmp_path / "sglang/config.json").read_text())
    vllm = json.loads((tmp_path / "vllm/config.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang adds 1 back
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: hidden_states indices, top level
    for layout in LAYOUTS:
        assert load_exported(tmp_path / layout).config.aux_layers == AUX
    # The vLLM dir is the official one plus the top-level key, so the plain loader reads it too.
    assert load_head(tmp_path / "vllm").config.aux_layers == AUX


def test_detection_without_our_record(target, tmp_path):
    head = make_head("eagle", target)
    export_head(head, tmp_path, "sglang")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eagle_mm_export"]
    assert detect_layout(config) == "sglang"
    (tmp_path / "config.json").write_text(json.dumps(config))
    back = load_exported(tmp_path)  # without the record, SGLang's always-present fc.bias stays (zeros)
    assert back.config.bias and torch.count_nonzero(back.fc.bias) == 0
    assert torch.equal(back.fc.weight, head.fc.weight)


def test_engine_limits_are_errors(target, tmp_path):
    with pytest.raises(ValueError, match="builds fc without a bias.*layout='sglang'"):
        export_head(make_head("eagle", target, bias=True), tmp_path / "a", "vllm")
    layer0 = Eagle3Head.from_target(target, aux_layers=(0, 2, 4))
    with pytest.raises(ValueError, match=r"vLLM 0\.17\.1 cannot capture aux layer 0 .* vLLM >= 0\.18\.0 captures it"):
        export_head(layer0, tmp_path / "b", "vllm", engine_version="0.17.1")
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.21 cannot capture aux layer 0 .* SGLang >= 0\.5\.22"):
        export_head(layer0, tmp_path / "b", "sglang", engine_version="0.5.21")
    with pytest.raises(ValueError, match=r"vLLM 0\.17\.1 cannot capture aux layer 0"):
        export_head(layer0, tmp_path / "b", "speculators", engine_version="v0.17.1")
    with pytest.raises(ValueError, match=r"not in ascending order: vLLM concatenates .* in layer order \(1, 3, 4\)"):
        export_head(Eagle3Head.from_target(target, aux_layers=(3, 1, 4)), tmp_path / "b", "vllm")
    with pytest.raises(ValueError, match="engine_version 'latest' is not a release number"):
        export_head(layer0, tmp_path / "b", "vllm", engine_version="latest")
    with pytest.raises(ValueError, match="the 'eagle' layout is served by neither"):
        export_head(layer0, tmp_path / "b", "eagle", engine_version="0.18.0")
    with pytest.raises(ValueError, match="qkv_proj without a bias"):
        export_head(make_head("eagle3", target, attention_bias=True), tmp_path / "c", "sglang")
    with pytest.raises(ValueError, match="unknown layout 'trt'; expected one of eagle, vllm, sglang"):
        export_head(make_head("eagle", target), tmp_path / "d", "trt")
    assert not any((tmp_path / d).exists() for d in "abc")  # nothing half-written


def test_attention_bias_pads_a_zero_o_proj_bias(target, tmp_path):
    head = make_head("eagle3", target, attention_bias=True)
    export_head(head, tmp_path, "vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.count_nonzero(tensors["midlayer.self_attn.o_proj.bias"]) == 0
    back = load_exported(tmp_path)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in head.state_dict().items())


def test_serving_commands(target, tmp_path):
    export_head(make_head("eagle3", target), tmp_path / "v", "vllm")
    export_head(make_head("eagle3", target), tmp_path / "s", "sglang")
    tree = TreeConfig(depth=5, top_k=8, total_tokens=63)
    vllm = serving_command(tmp_path / "v", "vllm", "meta/Llama", tree=tree)
    spec = json.loads(vllm.split("--speculative-config ", 1)[1].strip("'"))
    assert vllm.startswith("vllm serve meta/Llama ")
    assert spec == {"method": "eagle3", "model": str((tmp_path / "v").resolve()), "num_speculative_tokens": 5}
    sgl = serving_command(tmp_path / "s", "sglang", tree=tree).split()
    flags = dict(zip(sgl[5::2], sgl[6::2]))
    assert sgl[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "TARGET"]
    assert flags == {"--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": str((tmp_path / "s").resolve()),
                     "--speculative-num-steps": "5", "--speculative-eagle-topk": "8", "--speculative-num-draft-tokens": "64"}
    with pytest.raises(ValueError, match="holds the 'vllm' layout"):
        serving_command(tmp_path / "v", "sglang")


def _parser():
    parser = argparse.ArgumentParser(prog="eagle-mm")
    add_export_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.compat
def test_cli_export_prints_command(target, tmp_path, capsys):
    make_head("eagle3", target).save_pretrained(tmp_path / "head")
    target.config.save_pretrained(tmp_path / "target")  # config only: the exporter reads no target weights
    args = _parser().parse_args(["export", str(tmp_path / "head"), "--layout", "vllm", "--output",
                                 str(tmp_path / "out"), "--target", str(tmp_path / "target"), "--depth", "3"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"vllm serve {tmp_path / 'target'} --speculative-config" in out
    assert '"method": "eagle3"' in out and '"num_speculative_tokens": 3' in out
    assert load_exported(tmp_path / "out").config.aux_layers == AUX


def test_cli_errors_say_what_to_do(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["export", str(tmp_path), "--layout", "onnx", "--output", str(tmp_path / "o")])
    assert exc.value.code == 2 and "choose from 'eagle', 'vllm', 'sglang', 'speculators'" in capsys.readouterr().err
    args = _parser().parse_args(["export", str(tmp_path / "nope"), "--layout", "vllm", "--output", str(tmp_path / "o")])
    assert run_export(args) == 2
    assert "does not exist; pass a directory written by save_pretrained" in capsys.readouterr().err


def test_target_config_checks_and_positions(target, tmp_path):
    head = make_head("eagle3", target)
    long = target.config.__class__(**{**target.config.to_dict(), "max_position_embeddings": 8192})
    export_head(head, tmp_path / "s", "sglang", target_config=long)
    assert json.loads((tmp_path / "s/config.json").read_text())["max_position_embeddings"] == 8192  # rope cache size
    assert load_exported(tmp_path / "s").config == head.config  # restored: 2048
    short = target.config.__class__(**{**target.config.to_dict(), "num_hidden_layers": 4})
    with pytest.raises(ValueError, match=r"captures hidden_states indices 0\.\.3"):
        export_head(head, tmp_path / "v", "vllm", target_config=short)
    wide = target.config.__class__(**{**target.config.to_dict(), "hidden_size": 128})
    with pytest.raises(ValueError, match="hidden size 64 does not match the target's 128"):
        export_head(head, tmp_path / "v", "vllm", target_config=wide)


@pytest.mark.compat
def test_cli_exports_a_layer0_head(target, tmp_path, capsys):
    """The input embeddings as aux layer 0: vLLM's current loader reads the ids as (embeddings, mid, high)."""
    from tests.engine_oracles import vllm_native

    Eagle3Head.from_target(target, aux_layers=(0, 3, 5)).save_pretrained(tmp_path / "head")
    target.config.save_pretrained(tmp_path / "target")
    args = _parser().parse_args(["export", str(tmp_path / "head"), "--layout", "vllm", "--output",
                                 str(tmp_path / "out"), "--target", str(tmp_path / "target")])
    assert args.func(args) == 0
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 5]
    assert vllm_native(config, N_LAYERS, "0.34.0") == [0, 3, 5]  # stream positions: embeddings, layers 3 and 5 in
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("note: aux layer 0 (the input embeddings) is captured from vLLM 0.18.0 on (native model "
                        "implementation; not the Transformers backend, up to vLLM 0.34.0)")
    assert lines[2].startswith("vllm serve ")
    args = _parser().parse_args(["export", str(tmp_path / "head"), "--layout", "vllm", "--output",
                                 str(tmp_path / "old"), "--engine-version", "0.17.1"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM 0.17.1 cannot capture aux layer 0" in err


@pytest.mark.parametrize("layout", ["vllm", "sglang", "speculators"])
def test_cli_checks_aux_layers_without_target(layout, target, tmp_path, capsys):
    """Without --target the head's own aux layers are checked against the layout, and what needs the target's
    layer count is said before the serve command, not passed over."""
    Eagle3Head.from_target(target, aux_layers=(1, 3, 6)).save_pretrained(tmp_path / "last")  # 6 = N: normed output
    Eagle3Head.from_target(target, aux_layers=(1, 3, 3)).save_pretrained(tmp_path / "twice")
    target.config.save_pretrained(tmp_path / "target")

    def export(head, *extra):
        args = _parser().parse_args(["export", str(tmp_path / head), "--layout", layout, "--output",
                                     str(tmp_path / f"out-{head}-{len(extra)}"), *extra])
        return args.func(args), capsys.readouterr()

    status, out = export("last")
    assert status == 0
    notes = [line for line in out.out.splitlines() if line.startswith("note: ")]
    assert notes and "aux layers (1, 3, 6) are not checked against the target's layer count" in notes[0]
    assert "so 6 must be below N; pass the target to check" in notes[0]
    assert out.out.index("note: ") < out.out.index("--speculative-")
    status, out = export("last", "--target", str(tmp_path / "target"))
    assert status == 1 and out.err.count("\n") == 1 and "aux layer(s) [6] out of range" in out.err
    status, out = export("twice")
    assert status == 1 and out.err.count("\n") == 1 and "name a hidden state twice" in out.err
