"""A head whose dtype differs from its target's: ``attach`` casts it (logged once); a decode call casts a copy and
leaves the caller's head as it was."""
from __future__ import annotations

import logging

import pytest
import torch

import eagle_mm as em
from tests.tiny import prompt, tiny_model


def _dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype


@pytest.mark.parametrize("kind", (em.EagleHead, em.Eagle3Head))
def test_a_bf16_head_is_cast_to_an_fp32_target_and_decodes_exactly(kind, caplog):
    model = tiny_model("llama").eval()
    head = kind.from_target(model).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="eagle_mm.heads.base"):
        head.attach(model)
    assert _dtype(head) == torch.float32 and head.inv_freq.dtype == torch.float32
    casts = [r.getMessage() for r in caplog.records if "casting" in r.getMessage()]
    assert casts == [f"casting {kind.__name__} from torch.bfloat16 to the target's torch.float32"]
    ids = prompt(6)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_speculative_generate_decodes_an_fp32_head_with_a_bf16_target():
    model = tiny_model("llama").eval().to(torch.bfloat16)
    head = em.EagleHead.from_target(model).float()  # EAGLE-1 projects through the target's bf16 lm_head
    em.speculative_generate(model, head, input_ids=prompt(6), max_new_tokens=4, do_sample=False)
    assert _dtype(head) == torch.float32


def test_loading_keeps_the_dtype_read_and_decoding_too(tmp_path):
    model = tiny_model("llama").eval().to(torch.bfloat16)
    em.Eagle3Head.from_target(model).float().save_pretrained(tmp_path)
    head = em.load_head(tmp_path, target=model)  # the checkpoint's fp32, bit for bit (training keeps it so)
    assert _dtype(head) == torch.float32
    em.speculative_generate(model, head, input_ids=prompt(6), max_new_tokens=4, do_sample=False)
    assert _dtype(head) == torch.float32
