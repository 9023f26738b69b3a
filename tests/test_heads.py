"""Head structure: shapes, shared target parts, rotary settings, the reduced draft vocabulary."""
from __future__ import annotations

import json
import pytest
import torch

import eagle_mm as em
from eagle_mm.heads.layers import rope_cos_sin
from tests.tiny import V, prompt, tiny_model


@pytest.mark.compat
def test_eagle_head_shapes_and_shared_parts():
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    assert head.fc.weight.shape == (64, 128) and head.fc.bias is not None
    assert not hasattr(head.layers[0], "input_layernorm")  # EAGLE-1's first layer has none
    assert not hasattr(head, "norm")
    # The embedding and lm_head are the target's own modules, not copies, and not in the state dict.
    assert head.target_parts.embed is model.get_input_embeddings()
    assert head.target_parts.lm_head is model.get_output_embeddings()
    assert not any(k.startswith(("embed", "lm_head")) for k in head.state_dict())
    assert head.feature_layers(6) == (6,)


@pytest.mark.compat
def test_eagle3_head_shapes_and_defaults():
    model = tiny_model("llama", num_hidden_layers=8)
    head = em.Eagle3Head.from_target(model, draft_vocab_size=40)
    cfg = head.config
    assert cfg.aux_layers == (2, 4, 5) and head.feature_layers(8) == (2, 4, 5)
    assert head.fc.weight.shape == (64, 3 * 64) and head.fc.bias is None
    assert head.midlayer.self_attn.q_proj.weight.shape[1] == 2 * 64  # q/k/v over cat(embed, h)
    assert head.lm_head.weight.shape == (40, 64)
    assert head.d2t.shape == (40,) and head.t2d.shape == (V,) and int(head.t2d.sum()) == 40
    assert cfg.rope_theta == 10000.0


def test_eagle3_layer_zero_is_allowed():
    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model, aux_layers=(0, 3, 6))
    ids = prompt(7)
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(em.speculative_generate(model, head, input_ids=ids, max_new_tokens=10), ref)


def test_reduced_draft_vocab_maps_to_target_ids():
    model = tiny_model("qwen2")
    head = em.Eagle3Head.from_target(model, draft_vocab_size=24)
    chosen = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:24]
    head.set_draft_vocab(chosen)
    assert torch.equal(head.draft_to_target(torch.arange(24)), chosen.sort().values)
    assert torch.equal(head.t2d.nonzero().flatten(), chosen.sort().values)
    ids = prompt(9)
    ref = model.generate(ids, max_new_tokens=14, do_sample=False)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=14, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    with pytest.raises(ValueError, match="24 distinct"):
        head.set_draft_vocab(torch.arange(23))


def test_rope_theta_from_config_and_no_position_clamp():
    cfg = em.EagleConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=V, rope_theta=500000.0, max_position_embeddings=16)
    head = em.EagleHead(cfg)
    assert head.inv_freq[1].item() == pytest.approx(500000.0 ** (-2 / 16))
    far = torch.tensor([[15, 16, 5000]])
    cos, _ = rope_cos_sin(far, head.inv_freq, torch.float32)
    assert not torch.allclose(cos[0, 0, 1], cos[0, 0, 2])  # position 5000 is its own, not clamped to 15
    # bf16 heads keep fp32 rotary frequencies
    assert head.to(torch.bfloat16).inv_freq.dtype == torch.float32


def test_eagle3_feedback_bypasses_fc():
    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    with torch.no_grad():
        head.fc.weight.fill_(float("nan"))  # any use of fc on a fed-back state would poison the output
        e = head.embed(prompt(3))
        h = torch.randn(1, 3, 64)
        mask = torch.zeros(1, 1, 3, 3)
        out, logits, _ = head.step(e, h, torch.arange(3)[None], mask, None)
    assert torch.isfinite(out).all() and torch.isfinite(logits).all()


# ---- RoPE frequencies, default aux layers, the heads' imports ------------------------------------------
@pytest.mark.parametrize("head_dim, params", [
    (64, {"rope_type": "default", "rope_theta": 500000.0}),
    (128, {"rope_type": "default", "rope_theta": 1000000.0}),
    (64, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    (128, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
])
def test_rope_inv_freq_is_transformers_bit_for_bit(head_dim, params):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from eagle_mm.heads.layers import rope_inv_freq

    theirs = LlamaRotaryEmbedding(LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                                              rope_parameters=params)).inv_freq
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    ours = rope_inv_freq(head_dim, params["rope_theta"], scaling)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("layers, expected", [(4, (1, 2, 3)), (5, (1, 2, 4)), (6, (1, 3, 5)), (7, (2, 3, 4)),
                                              (32, (2, 16, 29))])
def test_default_aux_layers_are_distinct(layers, expected):
    """The official (2, N//2, N-3) where its indices differ; on 4-6 layers, where they collide, (1, N//2, N-1)."""
    assert em.Eagle3Config.default_aux_layers(layers) == expected
    model = tiny_model("llama", num_hidden_layers=layers)
    head = em.Eagle3Head.from_target(model)
    assert head.config.aux_layers == expected and head.fc.in_features == 3 * 64
    ids = prompt(6)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(em.speculative_generate(model, head, input_ids=ids, max_new_tokens=6), ref)


def test_engine_export_refuses_colliding_aux_layers(tmp_path):
    from eagle_mm.export import export_head

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model, aux_layers=(2, 3, 3))
    for layout in ("vllm", "sglang", "speculators"):
        with pytest.raises(ValueError, match=r"aux layers \(2, 3, 3\) name a hidden state twice.*e\.g\. \(1, 3, 5\)"):
            export_head(head, tmp_path / "out", layout, target_config=model.config)
    # Without ids, a 6-layer target gets ours written out: the engines' own default (2, 3, 3) collides there.
    fresh = em.Eagle3Head(head.config.replace(aux_layers=None))
    export_head(fresh, tmp_path / "spec", "speculators", target_config=model.config)
    export_head(fresh, tmp_path / "vllm", "vllm", target_config=model.config)
    for name in ("spec", "vllm"):
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


def test_heads_and_export_import_without_cycles():
    """Every import among eagle_mm.heads.* and eagle_mm.export, function-level (lazy) ones included, points one way."""
    import ast
    from pathlib import Path

    pkg = Path(em.__file__).parent
    files = {f"eagle_mm.heads.{p.stem}": p for p in (pkg / "heads").glob("*.py") if p.stem != "__init__"}
    files["eagle_mm.export"] = pkg / "export.py"
    edges = {}
    for name, path in files.items():
        package = name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(x for x in (base, node.module) if x)
                found |= {m for m in (module, *(f"{module}.{a.name}" for a in node.names)) if m in files}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in files}
        edges[name] = found - {name}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in edges[start])

    cycles = sorted(name for name in edges if reaches(name, name))
    assert not cycles, {name: sorted(edges[name]) for name in cycles}
    assert "eagle_mm.heads.io" not in edges["eagle_mm.heads.base"]
