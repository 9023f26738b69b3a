"""The speculators reference: a tiny official-layout EAGLE-3 head, its target, and the real converter.

`speculators==0.9.0` pins transformers <= 5.19, so it lives in its own venv (SPECULATORS_VENV, default
/work/venv-spec; docs/serving.md says how to make it). The committed fixture tests/fixtures/speculators_eagle3/ is what this module writes:

    python -m tests.speculators_reference   # rewrites the fixture with the real converter
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch

import eagle_mm as em
from tests.tiny import V, tiny_model

VENV = Path(os.environ.get("SPECULATORS_VENV", "/work/venv-spec"))
FIXTURE = Path(__file__).parent / "fixtures" / "speculators_eagle3"
# A narrower llama than tiny.py's default, so the two committed heads stay ~30 KB each.
TARGET = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1)
AUX = (1, 3, 4)  # HF hidden_states indices, not the default
AUX_LAYER0 = (0, 2, 4)  # the input embeddings as the low feature
DRAFT_V = 32


def target():
    return tiny_model("llama", **TARGET)


def official_head(model, aux=AUX, **flags) -> em.Eagle3Head:
    """A bf16 head with random weights (norms too), a permuted reduced vocabulary and custom aux layers."""
    head = em.Eagle3Head.from_target(model, aux_layers=aux, draft_vocab_size=DRAFT_V, **flags)
    head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:DRAFT_V])
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return head.to(torch.bfloat16)


def convert(head_dir: Path, target_dir: Path, out: Path, aux=AUX, **flags) -> None:
    """Run `speculators convert` (the reference writer) on local directories, then its own validation (loading
    the result against the verifier); flags: its EAGLE-3 variant options (norm_before_residual, norm_output:
    those its converter carries over with no extra weights)."""
    kwargs = json.dumps({"eagle_aux_hidden_state_layer_ids": list(aux), **flags})
    subprocess.run(
        [str(VENV / "bin" / "speculators"), "convert", str(head_dir), "--algorithm", "eagle3",
         "--verifier", str(target_dir), "--output-path", str(out), "--algorithm-kwargs", kwargs,
         "--validate-device", "cpu"],
        check=True, capture_output=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def build(root: Path, aux=AUX, **flags) -> tuple[Path, Path, Path]:
    """(target dir, official head dir, converted dir) under ``root``, converted by the real converter."""
    model = target()
    paths = root / "target", root / "official", root / "converted"
    model.save_pretrained(paths[0])
    official_head(model, aux, **flags).save_pretrained(paths[1])
    convert(paths[1], paths[0], paths[2], aux, **flags)
    return paths


def write_fixture() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _, official, converted = build(Path(tmp))
        shutil.rmtree(FIXTURE, ignore_errors=True)
        for name, src in (("official", official), ("converted", converted)):
            (FIXTURE / name).mkdir(parents=True)
            for file in ("config.json", "model.safetensors"):  # not the converter's config.py: their code
                shutil.copy(src / file, FIXTURE / name / file)


if __name__ == "__main__":
    write_fixture()
