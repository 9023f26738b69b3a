"""What both head kinds share: attaching to a target, the step signature, id mapping."""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..arch import TargetParts, execution_device, resolve_target
from .layers import rope_cos_sin, rope_inv_freq

logger = logging.getLogger(__name__)


class DraftHead(nn.Module):
    """Base of EagleHead and Eagle3Head.

    The target's token embedding (and, for EAGLE-1, its lm_head) are used, never copied or saved:
    they live in ``self._target`` (a plain attribute, so they are not submodules of the head).
    """

    kind: str = ""

    def __init__(self, config, target: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.register_buffer(
            "inv_freq", rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), persistent=False
        )
        self._target: TargetParts | None = None
        if target is not None:
            self.attach(target)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Module.to(dtype) casts buffers too, but rotary frequencies must stay fp32: in bf16 they drift
        # by ~0.4%, a phase error of radians at long positions.
        if self.inv_freq.dtype != torch.float32:
            cfg = self.config
            self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(self.inv_freq.device)
        return self

    # ---- target ------------------------------------------------------------------------------
    def attach(self, target: nn.Module, *, cast: bool = True) -> "DraftHead":
        """Bind to a target model after checking shapes; returns self.

        cast: a head whose float dtype differs from the target's is cast to it (logged), as decoding needs. False
        keeps the head's dtype: loaders return the tensors they read, training keeps fp32 beside a bf16 target.
        """
        parts = resolve_target(target)
        self._check_target(parts)
        # The head computes in the target's dtype: it feeds on the target's features and embeddings, and EAGLE-1
        # projects through the target's lm_head, where mixed dtypes fail (and bf16 on a CPU is slow).
        dtype, own = parts.embed.weight.dtype, self._dtype_device()[0]
        if cast and dtype.is_floating_point and dtype != own:
            logger.info("casting %s from %s to the target's %s", type(self).__name__, own, dtype)
            self.to(dtype)
        self._target = parts
        return self

    @property
    def target_parts(self) -> TargetParts:
        if self._target is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a target model; call head.attach(model)")
        return self._target

    def _check_target(self, parts: TargetParts) -> None:
        cfg = self.config
        if cfg.vocab_size != parts.vocab_size:
            raise ValueError(
                f"head vocab_size {cfg.vocab_size} does not match the target's embedding rows {parts.vocab_size}"
            )
        emb_dim = parts.embed.weight.shape[1]
        if cfg.hidden_size != emb_dim:
            raise ValueError(
                f"head hidden_size {cfg.hidden_size} does not match the target's embedding width {emb_dim} "
                f"(target text hidden_size {parts.hidden_size})"
            )

    def reads_images(self, parts: TargetParts) -> bool:
        """Whether the head reads the target's merged input embeddings (image features at image positions) rather
        than its own token embeddings: with a vision-language target, unless ``config.image_embeds`` is False."""
        return parts.is_vlm and getattr(self.config, "image_embeds", True)

    def hides_image_features(self, parts: TargetParts) -> bool:
        """Whether the head's features at image positions are zeroed (``config.image_features`` False, a VLM)."""
        return parts.is_vlm and not getattr(self.config, "image_features", True)

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        """HF ``hidden_states`` indices this head reads from a target with ``num_layers`` layers."""
        raise NotImplementedError

    # ---- checkpoints (layouts live in heads/io.py) ----------------------------------------------
    @classmethod
    def from_pretrained(cls, path, target: nn.Module | None = None, **kwargs) -> "DraftHead":
        """Load a head saved by ``save_pretrained`` or in an official EAGLE layout."""
        from .io import load_head

        head = load_head(path, target=target, **kwargs)
        if cls is not DraftHead and not isinstance(head, cls):
            raise ValueError(f"{path} holds a {type(head).__name__} checkpoint, not a {cls.__name__}")
        return head

    def save_pretrained(self, path, *, layout: str = "eagle", **kwargs) -> None:
        """Write config.json and model.safetensors with the head's own weights only.

        layout: "eagle" (official EAGLE), "vllm" or "sglang" (what that engine loads; see docs/serving.md).
        """
        if layout != "eagle":
            from ..export import export_head

            if kwargs:
                raise TypeError(f"save_pretrained(layout={layout!r}) takes no options {sorted(kwargs)}")
            export_head(self, path, layout)
            return
        from .io import save_head

        save_head(self, path, **kwargs)

    # ---- pieces of a draft step ------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings from the target's (frozen, shared) embedding table: (B, Q) -> (B, Q, H)."""
        emb = self.target_parts.embed
        with torch.no_grad():
            return emb(input_ids.to(execution_device(emb))).to(self._dtype_device()[1])

    def rope(self, position_ids: torch.Tensor):
        dtype, device = self._dtype_device()
        return rope_cos_sin(position_ids.to(device), self.inv_freq, dtype)

    def _dtype_device(self):
        p = next(self.parameters())
        return p.dtype, p.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, Q, F) -> the head's hidden input (B, Q, H)."""
        return features.to(self._dtype_device()[0])

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity when the vocabularies agree)."""
        return draft_ids

    def step(self, embeds, hidden, position_ids, mask, past):
        """One head forward.

        embeds (B, Q, H) token embeddings; hidden (B, Q, H) fused target features or fed-back head output;
        position_ids (B, Q); mask (B, 1, Q, S+Q) additive; past (k, v) (B, nkv, S, hd) or None.
        Returns (out (B, Q, H) fed back when drafting deeper, logits (B, Q, V_draft) fp32, new (k, v)).
        """
        raise NotImplementedError
