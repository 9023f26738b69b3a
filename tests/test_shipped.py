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
