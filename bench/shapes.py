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
