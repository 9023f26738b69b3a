"""EAGLE-3 variant flags: each one's numerics against a direct computation of its definition, lossless decoding,
bit-exact save/load in every layout that can express it, a clear error from those that cannot, and training."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import eagle_mm as em
from eagle_mm.export import export_head, load_exported
from tests.tiny import prompt, tiny_model

VARIANTS = em.Eagle3Config.VARIANTS
H = 64


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def variant_head(target, **flags) -> em.Eagle3Head:
    head = em.Eagle3Head.from_target(target, aux_layers=(1, 3, 4), draft_vocab_size=48, **flags)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # random norms too: a norm applied in the wrong place or not at all shows
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return head


def _rms(x, weight, eps=1e-6):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _direct(head, embeds, feats, pos, mask):
    """The head's step written out from the flags' definitions (speculators' Eagle3SpeculatorConfig)."""
    cfg, layer = head.config, head.midlayer
    x = feats
    if cfg.norm_before_fc:  # one norm over the concatenated features
        x = _rms(x, head.input_norm.weight)
    if cfg.fc_norm:  # one norm per feature
        x = torch.cat([_rms(part, norm.weight) for norm, part in zip(head.fc_norm, x.chunk(3, -1))], -1)
    h = x @ head.fc.weight.T
    normed = _rms(h, layer.hidden_norm.weight)
    residual = normed if cfg.norm_before_residual else h
    cos, sin = head.rope(pos)
    attn, _ = layer.self_attn(torch.cat((_rms(embeds, layer.input_layernorm.weight), normed), -1), cos, sin, mask,
                              None)
    h = residual + attn
    h = h + layer.mlp(_rms(h, layer.post_attention_layernorm.weight))
    out = _rms(h, head.norm.weight)
    logits = out @ head.lm_head.weight.T
    return (out if cfg.norm_output else h), logits


@pytest.mark.parametrize("flag", VARIANTS)
def test_numerics_follow_the_definition(target, flag):
    head = variant_head(target, **{flag: True})
    plain = variant_head(target)
    ids = prompt(7)
    feats = torch.randn(1, 7, 3 * H, generator=torch.Generator().manual_seed(1)) * 3
    pos, mask = torch.arange(7)[None], torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, logits, _ = head.step(head.embed(ids), head.fuse(feats), pos, mask, None)
        want_out, want_logits = _direct(head, head.embed(ids), feats, pos, mask)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(logits, want_logits)
        base_out, base_logits, _ = plain.step(plain.embed(ids), plain.fuse(feats), pos, mask, None)
    assert not torch.allclose(out, base_out) or not torch.allclose(logits, base_logits), "the flag changed nothing"


@pytest.mark.parametrize("flag", VARIANTS)
def test_decodes_losslessly(target, flag):
    head = variant_head(target, **{flag: True})
    ids = prompt(8)
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(em.speculative_generate(target, head, input_ids=ids, max_new_tokens=12), ref)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb) and a.config == b.config
    assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("flags", [{f: True} for f in VARIANTS]
                         + [dict(norm_before_residual=True, norm_before_fc=True, norm_output=True)])
@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_round_trips_bit_exactly(tmp_path, target, flags, layout):
    head = variant_head(target, **flags).to(torch.bfloat16)
    head.save_pretrained(tmp_path, layout=layout)
    back = em.load_head(tmp_path)
    _same(back, head)
    assert back.config.variants() == tuple(f for f in VARIANTS if flags.get(f))
    if layout == "speculators":
        config = json.loads((tmp_path / "config.json").read_text())
        assert all(config[f] == bool(flags.get(f)) for f in VARIANTS)
        keys = set(load_file(tmp_path / "model.safetensors"))
        assert ("input_norm.weight" in keys) == bool(flags.get("norm_before_fc"))
        assert ("fc_norm.2.weight" in keys) == bool(flags.get("fc_norm"))


def test_vllm_layout_expresses_norm_before_residual(tmp_path, target):
    head = variant_head(target, norm_before_residual=True).to(torch.bfloat16)
    export_head(head, tmp_path, "vllm")
    assert json.loads((tmp_path / "config.json").read_text())["norm_before_residual"] is True
    _same(load_exported(tmp_path), head)
    _same(em.load_head(tmp_path), head)


@pytest.mark.parametrize("layout, flag", [("vllm", "norm_before_fc"), ("vllm", "fc_norm"), ("vllm", "norm_output"),
                                          ("sglang", "norm_before_residual"), ("sglang", "norm_output")])
def test_layouts_that_cannot_express_a_variant_say_so(tmp_path, target, layout, flag):
    head = variant_head(target, **{flag: True})
    with pytest.raises(ValueError, match=rf"{layout} layout cannot express the EAGLE-3 variant\(s\) \['{flag}'\]"):
        export_head(head, tmp_path / "out", layout)
    assert not (tmp_path / "out").exists()  # refused before a byte is written


def test_exclusive_flags_and_the_official_head_has_none():
    with pytest.raises(ValueError, match="norm_before_fc .* fc_norm .* exclude each other"):
        em.Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=96, norm_before_fc=True, fc_norm=True)
    official = em.Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=96)
    assert official.variants() == () and not set(VARIANTS) & set(official.to_dict())


@pytest.mark.parametrize("flags", [dict(norm_before_residual=True, norm_before_fc=True, norm_output=True),
                                   dict(fc_norm=True)])
def test_trains_with_the_flags(tmp_path, flags):
    from eagle_mm.train import TrainConfig, train
    from tests.test_train_tools import greedy_rows, save_target, write_jsonl

    model = save_target(tmp_path / "target")
    data = write_jsonl(tmp_path / "data.jsonl", greedy_rows(model, 16))
    cfg = TrainConfig(target=str(tmp_path / "target"), data=data, output_dir=str(tmp_path / "out"), batch_size=8,
                      mixed_precision="no", save_dtype="float32", lr=3e-3, max_steps=12, log_every=1000,
                      save_every=1000, eval_samples=1, eval_max_new_tokens=4, **flags)
    result = train(cfg)
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
    head = em.Eagle3Head.from_pretrained(cfg.output_dir, target=model)
    assert head.config.variants() == tuple(f for f in VARIANTS if flags.get(f))
    norms = [head.input_norm.weight] if flags.get("norm_before_fc") else [n.weight for n in head.fc_norm]
    assert all(not torch.equal(w, torch.ones_like(w)) for w in norms)  # the variant's own norms learned
    with pytest.raises(ValueError, match=r"\['fc_norm'\] are EAGLE-3 head variants; kind='eagle'"):
        TrainConfig(target="t", output_dir="o", data="d", kind="eagle", fc_norm=True)


@pytest.mark.parametrize("layout", ["eagle", "vllm", "speculators"])
def test_target_hidden_size_round_trips(tmp_path, layout):
    """A head fusing features of a wider target (3 * 96 -> 64) keeps its fc width through every layout."""
    config = em.Eagle3Config(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=96, draft_vocab_size=48, target_hidden_size=96, aux_layers=(1, 3, 4))
    head = em.Eagle3Head(config).to(torch.bfloat16)
    with torch.no_grad():
        head.fc.weight.normal_()
    assert head.fc.in_features == 3 * 96
    export_head(head, tmp_path, layout)
    _same(em.load_head(tmp_path), head)
