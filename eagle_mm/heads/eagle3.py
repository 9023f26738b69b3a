"""Eagle3Head: the EAGLE-3 draft head.

fc fuses three target hidden states (3T -> H, no bias). The decoder layer attends over
cat(input_layernorm(embed), hidden_norm(h)) (2H wide q/k/v) with the residual on h; then ``norm`` and
an own ``lm_head`` over a reduced draft vocabulary. The variant flags of ``Eagle3Config``
(norm_before_residual, norm_before_fc, fc_norm, norm_output) add the norms their names say. ``d2t[i]`` is the offset from draft id i to its
target id; ``t2d`` marks the target ids that are in the draft vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn

from ..hf.parts import execution_device
from ..config import Eagle3Config
from .base import DraftHead, register_head_kind
from .layers import MLP, Attention, RMSNorm

__all__ = ["Eagle3Head"]


class _Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds, h, cos, sin, mask, past):
        normed = self.hidden_norm(h)
        if self.norm_before_residual:
            h = normed  # the residual around attention starts from the normed state
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # (B, Q, 2H)
        attn, kv = self.self_attn(x, cos, sin, mask, past)
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


@register_head_kind
class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, config: Eagle3Config, target: nn.Module | None = None):
        if not isinstance(config, Eagle3Config):
            raise TypeError(f"Eagle3Head needs an Eagle3Config, got {type(config).__name__}")
        super().__init__(config, target=None)
        H = config.hidden_size
        T = config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = RMSNorm(3 * T, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(T, config.rms_norm_eps) for _ in range(3)])
        self.fc = nn.Linear(3 * T, H, bias=False)
        self.midlayer = _Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        # Identity mapping by default (draft vocab = the first draft_vocab_size target ids).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        if target is not None:
            self.attach(target)

    @classmethod
    def from_target(cls, model: nn.Module, aux_layers=None, draft_vocab_size=None, **overrides) -> "Eagle3Head":
        """A freshly initialised head shaped for ``model``'s text config (a VLM's language model)."""
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
            target_hidden_size=tc.hidden_size,
            draft_vocab_size=draft_vocab_size,
            aux_layers=tuple(aux_layers) if aux_layers is not None else Eagle3Config.default_aux_layers(parts.num_layers),
        )
        kw.update(overrides)
        head = cls(Eagle3Config(**kw))
        return head.to(device=execution_device(parts.embed), dtype=parts.embed.weight.dtype).attach(model)

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        aux = self.config.aux_layers or Eagle3Config.default_aux_layers(num_layers)
        return tuple(aux)

    def _check_target(self, parts) -> None:
        super()._check_target(parts)
        cfg = self.config
        if cfg.target_hidden_size != parts.hidden_size:
            raise ValueError(
                f"Eagle3Head target_hidden_size {cfg.target_hidden_size} does not match the target's "
                f"hidden size {parts.hidden_size}"
            )
        bad = [i for i in self.feature_layers(parts.num_layers) if not 0 <= i <= parts.num_layers]
        if bad:
            raise ValueError(
                f"aux layer index {bad} out of range: the target has {parts.num_layers} layers, "
                f"so hidden_states indices go from 0 (input embeddings) to {parts.num_layers}"
            )

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use these target ids (draft_vocab_size of them, in draft-id order) as the draft vocabulary."""
        cfg = self.config
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if ids.numel() != cfg.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {cfg.draft_vocab_size} distinct target ids, got {ids.numel()} ({ids.unique().numel()} distinct)")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"target ids must lie in [0, {cfg.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
        ids = ids.sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        x = features.to(self.fc.weight.dtype)  # (B, Q, 3T)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        return self.fc(x)  # (B, Q, H)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def step(self, embeds, hidden, position_ids, mask, past):
        cos, sin = self.rope(position_ids)
        out, kv = self.midlayer(embeds, hidden, cos, sin, mask, past)
        normed = self.norm(out)
        if self.config.norm_output:
            out = normed  # fed back normed when drafting deeper
        logits = self.lm_head(normed).float()  # (B, Q, V_draft)
        return out, logits, kv
