"""Building blocks of the draft heads: RMSNorm, rotary embeddings, attention with an explicit KV cache, MLP.

Key names match the official EAGLE checkpoints (``self_attn.q_proj``, ``mlp.gate_proj``, ...), so a
state dict loads without renaming.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the Llama reference; cast back before the weight.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with optional linear or llama3 scaling.

    Computed in fp32 step by step as the official EAGLE code and transformers' LlamaRotaryEmbedding do, so the
    values are theirs bit for bit (a float64 computation rounded at the end differs in the last bit of about
    a third of the entries, a phase error that grows with the position).
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape (B, 1, Q, head_dim) for integer positions (B, Q). Positions are never clamped."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)  # (B, Q, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, Q, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Multi-head attention over an explicit past (k, v); ``in_dim`` is 2H for the EAGLE-3 layer."""

    def __init__(self, cfg, in_dim: int):
        super().__init__()
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.num_heads, self.num_kv_heads = hd, nh, nkv
        self.q_proj = nn.Linear(in_dim, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_dim, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_dim, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, past):
        """x (B, Q, in_dim); mask (B, 1, Q, S+Q) additive float; past (k, v) each (B, nkv, S, hd) or None.

        Returns the output (B, Q, H) and this call's new (k, v) (B, nkv, Q, hd); the caller owns the cache.
        """
        B, Q, _ = x.shape
        q = self.q_proj(x).view(B, Q, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, Q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, Q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_all = k if past is None else torch.cat((past[0], k), dim=2)
        v_all = v if past is None else torch.cat((past[1], v), dim=2)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask.to(q.dtype))  # (B, nh, Q, hd)
        out = out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
