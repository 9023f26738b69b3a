"""Tiny random-init targets of many families, built from config classes (nothing downloaded)."""
from __future__ import annotations

import torch
import transformers as tf

V = 96
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, tie_word_embeddings=False)


def _gemma(common):
    return dict(common, head_dim=16, query_pre_attn_scalar=16)


FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(_COMMON)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(_COMMON, sliding_window=8)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(_COMMON)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(_COMMON, head_dim=16)),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(_gemma(_COMMON), sliding_window=8)),
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(_gemma(_COMMON), sliding_window=8)),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(_COMMON, pad_token_id=0)),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, dict(_COMMON, pad_token_id=0)),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(_COMMON)),
}


def tiny_model(family: str = "llama", seed: int = 0, attn: str | None = None, **overrides):
    """attn: "sdpa" or "eager"; default sdpa where the family supports it."""
    cfg_cls, model_cls, kw = FAMILIES[family]
    cfg = cfg_cls(**{**kw, **overrides})
    if attn is None:
        attn = "sdpa" if model_cls._supports_sdpa else "eager"
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    # Random init gives near-uniform logits; sharpen them so greedy choices are far from ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, length), generator=g)


def module_hooks(model) -> dict[str, tuple]:
    """Every forward hook / pre-hook id, per module (HF installs its own output-recording hooks lazily)."""
    out = {}
    for name, m in model.named_modules():
        ids = (tuple(m._forward_pre_hooks), tuple(m._forward_hooks))
        if any(ids):
            out[name] = ids
    return out
