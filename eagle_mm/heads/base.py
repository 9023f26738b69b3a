"""What both head kinds share: attaching to a target, the step signature, id mapping; the registries.

Two registries cut the import cycle between the head classes and the checkpoint code (as PEFT's
``register_peft_method`` does): a head class registers its ``kind`` (``register_head_kind``), and each on-disk
layout registers how it is written and read (``register_layout``). The checkpoint modules (heads/io.py,
heads/engines.py, heads/speculators.py) import this module, never the other way round; importing
``eagle_mm.heads`` imports them all, so the registries are full before any head is saved or loaded.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..hf.parts import TargetParts, resolve_target
from .layers import rope_cos_sin, rope_inv_freq

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """One on-disk layout of a head.

    write(head, path, **options) writes it; read(path, target=None, *, dtype, device, strict) reads it back.
    ``claims(config_dict)`` tells a config.json of this layout; the official "eagle" layout is what no other
    layout claims, and its reader hands a directory another layout claims to that layout's reader.
    """

    name: str
    write: Callable
    read: Callable
    claims: Callable[[dict], bool]
    # config(config_dict, root) -> the head config, for layouts whose config.json is not the official one.
    config: Callable[[dict, object], object] | None = None


_KINDS: dict[str, type] = {}
_LAYOUTS: dict[str, Layout] = {}


def register_head_kind(cls: type) -> type:
    """Class decorator: make ``cls`` the head class built for checkpoints of kind ``cls.kind``."""
    if not cls.kind or cls.kind in _KINDS:
        raise ValueError(f"{cls.__name__}.kind must be a new non-empty name; registered: {sorted(_KINDS)}")
    _KINDS[cls.kind] = cls
    return cls


def head_class(kind: str) -> type:
    """The head class registered for ``kind`` ("eagle" or "eagle3")."""
    if kind not in _KINDS:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(_KINDS)}")
    return _KINDS[kind]


def register_layout(layout: Layout) -> None:
    if layout.name in _LAYOUTS:
        raise ValueError(f"layout {layout.name!r} is registered already")
    _LAYOUTS[layout.name] = layout


def get_layout(name: str) -> Layout:
    """The registered layout called ``name``."""
    if name not in _LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; expected one of {', '.join(_LAYOUTS)}")
    return _LAYOUTS[name]


def layout_names() -> tuple[str, ...]:
    """Names of the registered layouts, the official "eagle" first."""
    return tuple(_LAYOUTS)


def claiming_layout(config: dict) -> Layout | None:
    """The non-official layout whose config fields ``config`` has, or None for the official layout."""
    return next((lay for lay in _LAYOUTS.values() if lay.name != "eagle" and lay.claims(config)), None)


class PerTarget(weakref.WeakKeyDictionary):
    """What is kept with a head per target model, weakly keyed by the model (the decode package keeps its decoders
    here: ``eagle_mm.decoder``). Never copied, saved or pickled with the head: a copy starts empty."""

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return type(self), ()


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
        self._per_target = PerTarget()
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
        empty = next((n for n, p in self.named_parameters() if p.is_meta), None)
        if empty is not None and not parts.embed.weight.is_meta:
            raise ValueError(f"{type(self).__name__} has parameters on the meta device (no data, e.g. {empty}): load "
                             f"its weights (load_head, from_pretrained, or load_state_dict(..., assign=True)) before "
                             f"attaching it to a target")
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

    # ---- checkpoints (the layouts register themselves; see the module docstring) ------------------
    @classmethod
    def from_pretrained(cls, path, target: nn.Module | None = None, **kwargs) -> "DraftHead":
        """Load a head in any layout ``save_pretrained`` writes, an official EAGLE release or a speculators head."""
        head = get_layout("eagle").read(path, target=target, **kwargs)
        if cls is not DraftHead and not isinstance(head, cls):
            raise ValueError(f"{path} holds a {type(head).__name__} checkpoint, not a {cls.__name__}")
        return head

    def save_pretrained(self, path, *, layout: str = "eagle", **kwargs) -> None:
        """Write config.json and model.safetensors with the head's own weights only.

        layout: "eagle" (official EAGLE), "vllm", "sglang" (what that engine loads) or "speculators" (vLLM's
        speculators format); docs/serving.md tables them.
        """
        get_layout(layout).write(self, path, **kwargs)

    # ---- pieces of a draft step ------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings from the target's (frozen, shared) embedding table: (B, Q) -> (B, Q, H)."""
        parts = self._target if self._target is not None else self.target_parts  # the property names the fix
        with torch.no_grad():
            return parts.embed(input_ids.to(parts.embed_device)).to(self._dtype_device()[1])

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
