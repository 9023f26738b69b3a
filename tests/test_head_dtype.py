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


@pytest.mark.parametrize("kind", (em.EagleHead, em.Eagle3Head))
def test_a_call_leaves_the_callers_head_as_it_was(kind):
    """An fp32 head decoding with a bf16 target: the call casts a copy; the caller's head keeps its tensors bit for
    bit, its dtype and the target it was attached to."""
    fp32 = tiny_model("llama").eval()
    head = kind.from_target(fp32)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    parts = head.target_parts
    bf16 = tiny_model("llama").eval().to(torch.bfloat16)
    em.speculative_generate(bf16, head, input_ids=prompt(6), max_new_tokens=6, do_sample=False)
    after = head.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert head.target_parts is parts


def test_the_cast_copy_follows_the_head_when_it_is_trained():
    """The copy a bf16 target decodes with is made again when the caller's head changes in place (a training step):
    it holds the head's current weights, cast."""
    model = tiny_model("llama").eval().to(torch.bfloat16)
    head = em.Eagle3Head.from_target(model).float()
    em.speculative_generate(model, head, input_ids=prompt(6), max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        head.fc.weight.mul_(2)  # an optimizer step writes the parameters in place
    em.speculative_generate(model, head, input_ids=prompt(6), max_new_tokens=4, do_sample=False)
    copy = em.decoder(model, head).bind(torch.bfloat16)
    assert copy is not head and _dtype(copy) == torch.bfloat16 and _dtype(head) == torch.float32
    assert torch.equal(copy.fc.weight, head.fc.weight.to(torch.bfloat16))
