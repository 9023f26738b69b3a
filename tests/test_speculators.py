"""vLLM's speculators format: read what the real `speculators convert` wrote, write what it writes.

tests/fixtures/speculators_eagle3/ holds one tiny official-layout EAGLE-3 head (official/) and what
`speculators convert` (speculators 0.9.0) made of it (converted/); tests/speculators_reference.py rewrites
both. The slow test at the end reruns the converter itself from its own venv.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

import eagle_mm as em
from eagle_mm.heads.io import load_config
from tests import speculators_reference as ref
from tests.tiny import prompt

OFFICIAL, CONVERTED = ref.FIXTURE / "official", ref.FIXTURE / "converted"
# Fields the converter writes that we leave to the reader's defaults (LlamaConfig fills them), and the
# verifier's path, which is wherever the target lay when it ran.
_DEFAULTED = {"attention_dropout", "bos_token_id", "eos_token_id", "initializer_range", "mlp_bias", "pad_token_id",
              "pretraining_tp", "use_cache"}


@pytest.fixture(scope="module")
def target():
    return ref.target()


def _same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _same_drafts(dir_a, dir_b, target) -> None:
    """Both heads, loaded in the target's fp32, give bit-identical logits and outputs over a prompt's features,
    and decodes equal to the target's own greedy output."""
    a, b = (em.load_head(d, target=target, dtype=torch.float32) for d in (dir_a, dir_b))
    ids = prompt(9)
    feats = torch.randn(1, 9, 3 * ref.TARGET["hidden_size"], generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None]
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        outs = [h.step(h.embed(ids), h.fuse(feats), pos, mask, None)[:2] for h in (a, b)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    gen = target.generate(ids, max_new_tokens=12, do_sample=False)
    for head in (a, b):
        out = em.speculative_generate(target, head, input_ids=ids, max_new_tokens=12)
        assert torch.equal(out, gen)


def test_converted_fixture_loads_like_the_official_head(target):
    official = em.load_head(OFFICIAL, target=target)
    converted = em.Eagle3Head.from_pretrained(CONVERTED, target=target)
    assert converted.config == official.config and converted.config.aux_layers == ref.AUX
    assert load_config(CONVERTED) == official.config
    _same_state(converted.state_dict(), official.state_dict())
    _same_drafts(OFFICIAL, CONVERTED, target)


def _converter_config(path) -> dict:
    config = json.loads((path / "config.json").read_text())
    config.pop("auto_map")  # points at the config.py it writes beside: speculators' own code
    config.pop("transformers_version")
    config["speculators_config"]["verifier"].pop("name_or_path")
    for key in _DEFAULTED:
        config["transformer_layer_config"].pop(key)
    return config


def test_export_writes_what_the_converter_writes(tmp_path, target):
    head = em.load_head(OFFICIAL, target=target)
    head.save_pretrained(tmp_path / "ours", layout="speculators")
    _same_state(load_file(tmp_path / "ours" / "model.safetensors"), load_file(CONVERTED / "model.safetensors"))
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert ours["speculators_config"]["verifier"].pop("name_or_path") is None  # an in-memory target has no path
    assert ours == _converter_config(CONVERTED)
    _same_state(em.load_head(tmp_path / "ours").state_dict(), head.state_dict())


def test_eagle1_round_trip_and_keys(tmp_path, target):
    head = em.EagleHead.from_target(target)
    with torch.no_grad():
        head.fc.bias.normal_()
    head.save_pretrained(tmp_path, layout="speculators")
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert {"fusion_fc.weight", "fusion_fc.bias", "transformer.self_attn.q_proj.weight"} <= keys
    assert not any(k.startswith(("fc.", "layers.")) for k in keys)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["speculators_model_type"], config["fusion_bias"], config["layernorms"]) == ("eagle", True, False)
    back = em.load_head(tmp_path)
    assert isinstance(back, em.EagleHead) and back.config == head.config
    _same_state(back.state_dict(), head.state_dict())


def test_eagle1_with_layernorms_is_refused(tmp_path, target):
    em.EagleHead.from_target(target).save_pretrained(tmp_path, layout="speculators")
    state = load_file(tmp_path / "model.safetensors")
    state["embedding_layernorm.weight"] = torch.ones(ref.TARGET["hidden_size"])
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="layernorms=true .* variant EagleHead does not have"):
        em.load_head(tmp_path)


def test_not_an_eagle_speculator(tmp_path):
    config = json.loads((CONVERTED / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, speculators_model_type="mtp")))
    with pytest.raises(ValueError, match=r"speculators_model_type='mtp' is not an EAGLE head"):
        em.load_head(tmp_path)


def test_serving_command_for_the_speculators_layout(tmp_path, target):
    from eagle_mm.export import serving_command

    em.load_head(OFFICIAL).save_pretrained(tmp_path, layout="speculators", target_config=target.config)
    cmd = serving_command(tmp_path, "speculators", "my/target", tree=em.TreeConfig.chain(3))
    assert cmd.startswith("vllm serve my/target --speculative-config ") and '"method": "eagle3"' in cmd
    assert '"num_speculative_tokens": 3' in cmd


def test_cli_export_speculators(tmp_path, target, capsys):
    import argparse

    from eagle_mm.cli.export import add_export_parser

    parser = argparse.ArgumentParser(prog="eagle-mm")
    add_export_parser(parser.add_subparsers(dest="command", required=True))
    target.config.save_pretrained(tmp_path / "target")  # config only: the exporter reads no target weights
    args = parser.parse_args(["export", str(OFFICIAL), "--layout", "speculators", "--output", str(tmp_path / "out"),
                              "--target", str(tmp_path / "target"), "--depth", "4"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"vllm serve {tmp_path / 'target'} --speculative-config" in out and '"num_speculative_tokens": 4' in out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    _same_state(load_file(tmp_path / "out" / "model.safetensors"), load_file(CONVERTED / "model.safetensors"))


# ---- the reference converter itself -----------------------------------------------------------------
needs_venv = pytest.mark.skipif(not (ref.VENV / "bin" / "speculators").exists(),
                                reason=f"no speculators venv at {ref.VENV} (see tests/speculators_reference.py)")


@pytest.mark.slow
@needs_venv
@pytest.mark.parametrize("aux, flags", [(ref.AUX, {}), (ref.AUX, {"norm_before_residual": True, "norm_output": True}),
                                        (ref.AUX_LAYER0, {})], ids=["official", "variants", "layer0"])
def test_real_converter_round_trip(tmp_path, aux, flags):
    """Convert with `speculators convert` (and its validation); our load equals the official one, our export
    equals the converter's files, and speculators' own loaders (the converter's validation model and
    Eagle3DraftModel, which checks the ids against the verifier) read our export."""
    from transformers import AutoConfig

    target_dir, official_dir, converted_dir = ref.build(tmp_path, aux, **flags)
    model = ref.target()
    official = em.load_head(official_dir, target=model)
    converted = em.load_head(converted_dir, target=model)
    assert converted.config == official.config and converted.config.aux_layers == aux
    _same_state(converted.state_dict(), official.state_dict())
    _same_drafts(official_dir, converted_dir, model)

    ours = tmp_path / "ours"
    official.save_pretrained(ours, layout="speculators", target_config=AutoConfig.from_pretrained(target_dir))
    _same_state(load_file(ours / "model.safetensors"), load_file(converted_dir / "model.safetensors"))
    mine = json.loads((ours / "config.json").read_text())
    assert mine["speculators_config"]["verifier"].pop("name_or_path") == str(target_dir)
    assert mine == _converter_config(converted_dir)

    read = ("import json, sys; "
            "from speculators.models.eagle3 import Eagle3SpeculatorConfig as C, Eagle3DraftModel as D; "
            "from speculators.convert.eagle.eagle3_legacy_model import Eagle3Speculator as S; "
            "c = C.from_pretrained(sys.argv[1]); t = c.transformer_layer_config; "
            "s = S.from_pretrained(sys.argv[1], verifier=sys.argv[2], verifier_attachment_mode='detached'); "
            "d = D.from_pretrained(sys.argv[1]); "
            "print(json.dumps([c.draft_vocab_size, c.eagle_aux_hidden_state_layer_ids, c.target_hidden_size, "
            "t.hidden_size, t.vocab_size, t.num_key_value_heads, c.speculators_config.algorithm, "
            "c.norm_before_residual, c.norm_output, d.target_layer_ids, list(d.fc.weight.shape), "
            "list(s.fc.weight.shape)]))")
    out = subprocess.run([str(ref.VENV / "bin" / "python"), "-c", read, str(ours), str(target_dir)], check=True,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    variants = [bool(flags.get("norm_before_residual")), bool(flags.get("norm_output"))]
    assert json.loads(out.strip().splitlines()[-1]) == [ref.DRAFT_V, list(aux), 32, 32, 96, 1, "eagle3", *variants,
                                                        list(aux), [32, 96], [32, 96]]
    assert official.config.variants() == tuple(sorted(flags, key=em.Eagle3Config.VARIANTS.index))
