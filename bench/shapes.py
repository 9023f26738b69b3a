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
