"""Targets split with device_map (layers offloaded to disk behind accelerate's hooks) stay lossless."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import eagle_mm as em
from tests.doubles import ForcedHead
from tests.tiny import prompt, tiny_model


@pytest.mark.compat
@pytest.mark.parametrize("kind", [em.EagleHead, em.Eagle3Head])
def test_device_map_with_disk_offloaded_layers(tmp_path, kind):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "target")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": ("disk" if i in (2, 4) else "cpu") for i in range(6)})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "target", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload"),
                                                 attn_implementation="sdpa").eval()
    assert hasattr(model.model.layers[2], "_hf_hook")  # really behind accelerate's offload hook
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids = prompt(7)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(ref, base.generate(ids, max_new_tokens=20, do_sample=False))
    long = model.generate(ids, max_new_tokens=40, do_sample=False)[0]
    wrong = torch.rand(long.numel(), generator=torch.Generator().manual_seed(0)) < 0.2
    head = ForcedHead(kind.from_target(model), long, wrong)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=20,
                                  tree=em.TreeConfig(depth=4, top_k=2, total_tokens=8), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accept_length > 2
