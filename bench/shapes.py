"""Shapes and builders shared by the GPU benchmarks (run from the repository root with PYTHONPATH=.)."""
from __future__ import annotations

import torch

# Llama-3.1-8B's text config.
SHAPE_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)


def random_8b_target(layers: int = 32):
    """A random-init Llama-3.1-8B-shaped target, bf16 on CUDA, frozen (``layers`` < 32 for smoke runs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**SHAPE_8B, "num_hidden_layers": layers}, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16 directly: no 32 GB fp32 detour
    try:
        with torch.device("cuda"):
            return LlamaForCausalLM(cfg).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


# Qwen2.5-0.5B's text config (its lm_head untied here: ``make_peaked`` needs its own rows).
SHAPE_QWEN05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768)


def random_qwen05b_target():
    """A random-init Qwen2.5-0.5B-shaped target in fp32 on the CPU, frozen: 2.5 GB of weights per forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPE_QWEN05B, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval().requires_grad_(False)


@torch.no_grad()
def make_peaked(model, *, embed_scale: float = 100.0, logit_scale: float = 0.125, seed: int = 0) -> None:
    """Rearrange a random Llama's embeddings and lm_head (in place) so that greedy decoding follows a fixed random
    permutation of the vocabulary with a wide margin: the next token after t is perm[t].

    Why: with plain random weights the top two logits are often within bf16 rounding, and the verify forward (many
    query tokens) rounds differently from the reference decode, so a forced-acceptance run derails at the first
    near-tie and its acceptance collapses (measured on the H200, 2026-11-29). Here the embedding dominates the
    residual stream (``embed_scale``: the layers' outputs are small beside it), so the final hidden state points
    along e_t, and lm_head row perm[t] is e_t's unit vector: logit ~ ``logit_scale`` * sqrt(H) for perm[t] against
    ~``logit_scale`` for the rest. Shapes, dtypes and kernels are unchanged, so speed is measured as before.
    """
    emb = model.get_input_embeddings().weight  # (V, H)
    head = model.get_output_embeddings().weight  # (V, H), untied
    if head.data_ptr() == emb.data_ptr():
        raise ValueError("make_peaked needs an untied lm_head (tie_word_embeddings=False)")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(emb.shape[0], generator=g).to(emb.device)  # next(t) = perm[t]
    emb.mul_(embed_scale)
    unit = emb.float() / emb.float().norm(dim=1, keepdim=True)
    head.copy_((unit * logit_scale)[torch.argsort(perm)])  # row perm[t] = unit(e_t) * logit_scale


# Qwen2.5-VL-7B-Instruct's text config (M-RoPE over temporal, height, width: 16 + 24 + 24 rotary pairs), with its
# own token ids; the vision tower is a small one (2 blocks, 256 wide) with the real patching and merger output.
SHAPE_QWEN25VL7B_TEXT = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                             intermediate_size=18944, vocab_size=152064, max_position_embeddings=128000,
                             rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                                     mrope_section=[16, 24, 24]))
SHAPE_QWEN25VL_SMALL_VISION = dict(depth=2, hidden_size=256, intermediate_size=512, num_heads=4, patch_size=14,
                                   spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                                   fullatt_block_indexes=[1])
QWEN25VL_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653)


def random_qwen25vl_target(text: dict, vision: dict, tokens: dict, device: str = "cuda", dtype=torch.bfloat16):
    """A random-init Qwen2.5-VL target, frozen, built directly in ``dtype`` on ``device`` (no fp32 detour on the GPU).
    The vision tower's output width is the text hidden size; the lm_head is untied (``make_peaked`` needs it)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(text, model_type="qwen2_5_vl_text", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, out_hidden_size=text["hidden_size"]),
                           tie_word_embeddings=False, **tokens)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2_5_VLForConditionalGeneration(cfg).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
