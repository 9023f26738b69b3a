"""Exported aux ids, read back the way each engine's loader reads them, capture what the head was trained on.

For 4-, 6- and 32-layer targets and aux sets with and without layer 0 (the input embeddings): the states each
engine release captures from the exported config.json (tests/engine_oracles.py, re-implemented from their
source) are compared with the features eagle_mm trains the head on (FeatureCapture). An export that names the
release succeeds exactly when that release captures the trained features; where it refuses, the same ids
written anyway are shown to capture something else or to fail in the engine.
"""
from __future__ import annotations

import json

import pytest
import torch

from eagle_mm import Eagle3Config, Eagle3Head
from eagle_mm.export import export_head, export_notes, load_exported
from eagle_mm.heads.aux_ids import FIRST_ID, PLUS_ONE, engine_ids
from eagle_mm.hf.features import FeatureCapture
from eagle_mm.hf.parts import resolve_target
from tests import engine_oracles as oracles
from tests.tiny import prompt, tiny_model

LAYOUTS = ("vllm", "sglang", "speculators")
ENGINE_FAILS = (TypeError, KeyError, ValueError)


def aux_sets(n: int) -> list[tuple[int, int, int]]:
    """Ascending aux sets: the default, with layer 0 (with and without index 2, which decides SGLang's rule)
    and without it."""
    candidates = [Eagle3Config.default_aux_layers(n), (0, n // 2, n - 1), (0, 1, n - 1), (0, 2, n - 1),
                  (1, n // 2, n - 1), (1, 3, n - 1)]
    return sorted({c for c in candidates if len(set(c)) == 3 and list(c) == sorted(c)})


def residual_stream(model, ids) -> dict[int, torch.Tensor]:
    """Position k -> the target's residual stream after k decoder layers (N: before the final norm)."""
    layers = model.model.layers
    last = {}
    handle = layers[-1].register_forward_hook(
        lambda module, args, out: last.setdefault("out", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    handle.remove()
    n = len(layers)
    stream = {k: out.hidden_states[k] for k in range(n)}
    stream[n] = last["out"]
    # HF's hidden_states[N] (eagle_mm's index N) is the normed output: not a state either engine captures.
    assert torch.equal(out.hidden_states[n], model.model.norm(stream[n]))
    return stream


def read_back(reader, config, n, stream):
    """What the engine's fc receives, (B, T, 3 * hidden), or the exception the engine raises."""
    try:
        positions = reader(config, n)
    except ENGINE_FAILS as e:
        return e
    return torch.cat([stream[k] for k in positions], dim=-1)


def _check_layout(head, model, layout, tmp_path, stream, trained, *, target_config=None, architectures=None):
    n = len(model.model.layers)
    architectures = architectures or ("LlamaForCausalLM",)
    for name, release, reader in oracles.readers(layout, architectures):
        out = tmp_path / f"{layout}-{(release or 'tf').replace('.', '_')}"
        try:
            export_head(head, out, layout, target_config=target_config, engine_version=release)
        except ValueError as refusal:
            # Refused: the ids the export would otherwise write do not give this release the trained features.
            rule = FIRST_ID if set(architectures) & oracles.FIRST_ID_ARCHITECTURES else PLUS_ONE
            ids = engine_ids(head.config.aux_layers, layout, rule=rule)
            config = {oracles.KEY: ids} if layout != "sglang" else {"eagle_config": {oracles.KEY: ids}}
            got = read_back(reader, config, n, stream)
            assert isinstance(got, Exception) or not torch.equal(got, trained), f"{name}: refused ({refusal})"
            continue
        config = json.loads((out / "config.json").read_text())
        got = read_back(reader, config, n, stream)
        if release is None and 0 in head.config.aux_layers:
            # vLLM's Transformers backend (up to 0.34.0) records no layer 0; the export says so in a note.
            assert isinstance(got, KeyError)
            assert any("not the Transformers backend" in note for note in export_notes(head, layout))
            continue
        assert not isinstance(got, Exception) and torch.equal(got, trained), (
            f"{name} reads {config.get(oracles.KEY) or config.get('eagle_config')} as {got!r}, not aux "
            f"{head.config.aux_layers}")


@pytest.mark.parametrize("n", [4, 6, 32])
def test_engines_capture_the_trained_features(n, tmp_path):
    model = tiny_model("llama", num_hidden_layers=n)
    ids = prompt(7)
    stream = residual_stream(model, ids)
    parts = resolve_target(model)
    for aux in aux_sets(n):
        head = Eagle3Head.from_target(model, aux_layers=aux)
        with FeatureCapture(parts, head.feature_layers(n)) as cap, torch.no_grad():
            model(ids)
        trained = cap.features()
        for layout in LAYOUTS:
            _check_layout(head, model, layout, tmp_path / f"{aux}", stream, trained)
            assert load_exported(_any_export(tmp_path / f"{aux}", layout)).config.aux_layers == aux


def _any_export(root, layout):
    return next(p for p in sorted(root.iterdir()) if p.name.startswith(layout + "-"))


@pytest.mark.parametrize("n", [6, 32])
def test_sglang_first_id_rule_targets(n, tmp_path):
    """A target SGLang serves with deepseek_v2.py (first-id rule from 0.5.13): the ids follow its architecture,
    and with index 2 among them they read alike under both rules."""
    model = tiny_model("llama", num_hidden_layers=n)
    ids = prompt(7)
    stream = residual_stream(model, ids)
    parts = resolve_target(model)
    deepseek = model.config.__class__(**{**model.config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    for aux in aux_sets(n):
        head = Eagle3Head.from_target(model, aux_layers=aux)
        with FeatureCapture(parts, head.feature_layers(n)) as cap, torch.no_grad():
            model(ids)
        trained = cap.features()
        _check_layout(head, model, "sglang", tmp_path / f"{aux}", stream, trained, target_config=deepseek,
                      architectures=("DeepseekV3ForCausalLM",))
        written = json.loads((_any_export(tmp_path / f"{aux}", "sglang") / "config.json").read_text())
        if 2 in aux:  # one list both rules read alike: a llama-served copy of these ids captures the same
            assert torch.equal(read_back(lambda c, k: oracles.sglang(c, k, "0.5.23"), written, n, stream), trained)


def test_final_output_is_refused_everywhere(tmp_path):
    """Index N is the normed output; vLLM captures the pre-norm one (or nothing), SGLang nothing."""
    model = tiny_model("llama", num_hidden_layers=6)
    head = Eagle3Head.from_target(model, aux_layers=(1, 3, 6))
    for layout in LAYOUTS:
        with pytest.raises(ValueError, match=r"captures hidden_states indices 0\.\.5 \(index 6, the final normed"):
            export_head(head, tmp_path / layout, layout)
