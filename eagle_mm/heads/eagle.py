"""EagleHead: the EAGLE-1/2 draft head.

fc(cat(embed(token), feature)) -> one Llama decoder layer without input layernorm -> the target's lm_head.
Its input feature is the target's last hidden state (after the final norm); when drafting deeper it
feeds back its own output, which is a prediction of that feature.
"""
from __future__ import annotations

import torch
from torch import nn

from ..hf.parts import execution_device
from ..config import EagleConfig
from .base import DraftHead, register_head_kind
from .layers import MLP, Attention, RMSNorm

__all__ = ["EagleHead"]


class _EagleLayer(nn.Module):
    """Llama decoder layer whose input layernorm is absent (the first-layer convention of EAGLE-1)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past):
        attn, kv = self.self_attn(x, cos, sin, mask, past)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


@register_head_kind
class EagleHead(DraftHead):
    kind = "eagle"

    def __init__(self, config: EagleConfig, target: nn.Module | None = None):
        if not isinstance(config, EagleConfig):
            raise TypeError(f"EagleHead needs an EagleConfig, got {type(config).__name__}")
        super().__init__(config, target=None)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList([_EagleLayer(config)])
        if target is not None:
            self.attach(target)

    @classmethod
    def from_target(cls, model: nn.Module, **overrides) -> "EagleHead":
        """A freshly initialised head shaped for ``model`` (its text config's sizes); fields can be overridden."""
        from ..hf.parts import resolve_target

        parts = resolve_target(model)
        tc = parts.text_config
        kw = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None),
            vocab_size=parts.vocab_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        )
        kw.update(overrides)
        head = cls(EagleConfig(**kw))
        dtype = parts.embed.weight.dtype
        return head.to(device=execution_device(parts.embed), dtype=dtype).attach(model)

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)

    def _check_target(self, parts) -> None:
        super()._check_target(parts)
        if self.config.hidden_size != parts.hidden_size:
            raise ValueError(
                f"EagleHead hidden_size {self.config.hidden_size} does not match the target's hidden size {parts.hidden_size}"
            )

    def step(self, embeds, hidden, position_ids, mask, past):
        x = self.fc(torch.cat((embeds, hidden.to(embeds.dtype)), dim=-1))  # (B, Q, H)
        cos, sin = self.rope(position_ids)
        out, kv = self.layers[0](x, cos, sin, mask, past)
        lm_head = self.target_parts.lm_head
        logits = lm_head(out.to(execution_device(lm_head), lm_head.weight.dtype)).float()  # (B, Q, V)
        return out, logits.to(out.device), kv
