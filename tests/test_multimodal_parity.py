"""Greedy speculative output on vision-language targets equals model.generate(do_sample=False) token for token.

Each family runs one image first, an image in the middle of the text, two images (of different sizes where
the family allows), and a text-only prompt; a tree and a chain; a random head and a ForcedHead that mostly
proposes the target's own continuation (long accepted paths through every cache kind).
Llama 4's cases are marked compat: transformers 5.24 cannot run its VLM forward, so the 5.17 job runs them;
Qwen3-VL's batch case is too, a fast check of its positions and deepstack inputs on 5.17.
"""
from __future__ import annotations

import pytest
import torch

import eagle_mm as em
from tests.doubles import ForcedHead
from tests.test_multimodal_tiny import QWEN, compat_params, head_for, needs_working_forward, picture, tiny_vlm
from tests.test_multimodal_tiny import one_thread  # noqa: F401  (autouse: one torch thread in this module)

TREES = (em.TreeConfig(depth=4, top_k=3, total_tokens=8), em.TreeConfig.chain(4))
PROMPTS = {
    "image first": ([["img", [11, 12, 13]]], [picture(1)]),
    "image in the middle": ([[[5, 6, 7], "img", [8, 9]]], [picture(2)]),
    "two images": ([[[5], "img", [21, 22], "img", [23]]], [picture(3), picture(4, size=(112, 56))]),
    "text only": ([[[5, 6, 7, 8, 9, 10]]], []),
}
N_NEW, N_RANDOM = 14, 8




def _forced(head, ref: torch.Tensor, seed: int) -> ForcedHead:
    g = torch.Generator().manual_seed(seed)
    wrong = torch.rand(ref.shape[-1], generator=g) < 0.2
    return ForcedHead(head, ref[0], wrong)


# transformers 5.24 cannot run Llama 4's VLM forward at all; CI's 5.17 job (compat) covers it.
@pytest.mark.parametrize("family", compat_params("llama4"))
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_equals_generate(family, kind):
    needs_working_forward(family)
    tiny = tiny_vlm(family)
    model = tiny.model
    head = head_for(kind, model)
    for name, (rows, images) in PROMPTS.items():
        inputs = tiny.inputs(rows, images)
        ref = model.generate(**inputs, max_new_tokens=N_NEW, do_sample=False)
        for i, tree in enumerate(TREES):
            # The random head accepts about one token per cycle: fewer new tokens (a prefix of ref) suffice.
            out = em.speculative_generate(model, head, **inputs, max_new_tokens=N_RANDOM, tree=tree)
            assert torch.equal(out, ref[:, : ref.shape[1] - N_NEW + N_RANDOM]), (family, kind, name, tree, "random")
            forced = _forced(head, ref, seed=i)
            out = em.speculative_generate(model, forced, **inputs, max_new_tokens=N_NEW, tree=tree,
                                          return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref), (family, kind, name, tree, "forced head")
            assert out.stats.mode is None
            assert out.stats.mean_accept_length > 2.0, (family, name, out.stats)


@pytest.mark.parametrize("family", compat_params("llama4", "qwen3_vl"))
def test_left_padded_batch_with_different_images_per_row(family):
    """Rows with two images, one image and none: per-row M-RoPE offsets, padding holes, cache compaction."""
    needs_working_forward(family)
    tiny = tiny_vlm(family)
    model = tiny.model
    rows = [[[5], "img", [6, 7], "img", [8]], [[9, 10], "img", [11]], [[12, 13, 14]]]
    inputs = tiny.inputs(rows, [picture(5), picture(6), picture(7)])
    assert bool((inputs["attention_mask"] == 0).any())
    ref = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    head = head_for("eagle3", model)
    out = em.speculative_generate(model, head, **inputs, max_new_tokens=12, tree=TREES[0])
    assert torch.equal(out, ref)
    # ForcedHead reads its reference by position: drop each row's left padding.
    pad = (inputs["attention_mask"] == 0).sum(1).tolist()
    reference = torch.stack([torch.cat((r[p:], r[:p])) for r, p in zip(ref, pad)])
    wrong = torch.rand(reference.shape, generator=torch.Generator().manual_seed(0)) < 0.2
    forced = ForcedHead(head, reference, wrong)
    out = em.speculative_generate(model, forced, **inputs, max_new_tokens=12, tree=TREES[1],
                                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accept_length > 2.0 and out.stats.mode is None


@pytest.mark.parametrize("family", QWEN)
def test_qwen_rope_offsets_are_the_models_rope_deltas(family):
    """For prompts ending in text, text position + offset is the model's own rope_deltas rule, on every axis."""
    from eagle_mm.hf.multimodal import ImagePrompt, rope_offsets

    tiny = tiny_vlm(family)
    inputs = tiny.inputs([[[5], "img", [6, 7], "img", [8]], [[9, 10], "img", [11]]],
                         [picture(1), picture(2, size=(112, 56)), picture(3)])
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8], [1, 4, 4]]  # 4, 8 and 4 image tokens
    mask = inputs["attention_mask"]
    pos3, deltas = tiny.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   image_grid_thw=inputs["image_grid_thw"], attention_mask=mask)
    text_pos = (mask.cumsum(-1) - 1).clamp(min=0)
    offsets = rope_offsets(ImagePrompt({}, pos3), text_pos)
    assert offsets.shape == (3, 2)
    assert torch.equal(offsets, deltas.view(1, -1).expand(3, -1))
    assert bool((deltas != 0).all())  # the images do shift the text positions
