"""Configuration dataclasses: draft heads and draft trees.

One dataclass per config, validated in ``__post_init__``; every default lives here once.
The head configs read and write the official EAGLE ``config.json`` layouts (llama-style fields).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["EagleConfig", "Eagle3Config", "TreeConfig"]

_ROPE_TYPES = ("default", "linear", "llama3")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class _HeadConfigBase:
    """Fields shared by both head kinds: the shape of the one Llama-style decoder layer."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    # Official EAGLE-3 heads were trained with theta 10000 when their config has none.
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    # Informational only: head positions are never clamped to it.
    max_position_embeddings: int = 2048
    # With a vision-language target: at image positions the head reads the target's merged image embeddings
    # (True), or the image placeholder token's own embedding, the image hidden from its input (False: an
    # ablation). Honoured in training (eagle_mm.train) and by speculative_generate; saved only when False.
    image_embeds: bool = True
    # With a vision-language target: the head reads the target's features at image positions (True), or zeros
    # there (False: with image_embeds=False the draft sees nothing of the image's own positions, only what the
    # target carries into the text after it; the stricter ablation). Honoured like image_embeds; saved only when False.
    image_features: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
            _positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        for name in ("image_embeds", "image_features"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be one of silu, gelu, gelu_pytorch_tanh; got {self.hidden_act!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in _ROPE_TYPES:
                raise ValueError(f"rope_scaling type {kind!r} is not supported; expected one of {_ROPE_TYPES}")

    # ---- JSON: the official llama-style layout -------------------------------------------------
    def _llama_fields(self) -> dict:
        d = {
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        for name in ("image_embeds", "image_features"):  # official layouts have no such keys; defaults need none
            if not getattr(self, name):
                d[name] = False
        return d

    @classmethod
    def _common_kwargs(cls, d: dict) -> dict:
        """Pick the shared fields out of an official config dict (missing optional fields keep defaults)."""
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"head config is missing required field(s) {missing}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"draft heads have exactly one decoder layer; config has num_hidden_layers={d['num_hidden_layers']}")
        kw = {k: d[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")}
        kw["num_key_value_heads"] = d.get("num_key_value_heads") or d["num_attention_heads"]
        for k in ("head_dim", "rms_norm_eps", "hidden_act", "attention_bias", "max_position_embeddings",
                  "image_embeds", "image_features"):
            if d.get(k) is not None:
                kw[k] = d[k]
        # transformers 5 writes rope settings into `rope_parameters`; older files use `rope_theta`/`rope_scaling`.
        rope = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope.get("rope_theta"))
        if theta is not None:
            kw["rope_theta"] = float(theta)
        scaling = d.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            kw["rope_scaling"] = dict(scaling)
        return kw

    def replace(self, **changes):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass
class EagleConfig(_HeadConfigBase):
    """EAGLE-1/2 head: ``fc`` over ``cat(embed, feature)`` then one decoder layer; logits via the target's head."""

    bias: bool = True

    def to_dict(self) -> dict:
        d = self._llama_fields()
        d["architectures"] = ["LlamaForCausalLM"]
        d["bias"] = self.bias
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        kw = cls._common_kwargs(d)
        kw["bias"] = bool(d.get("bias", True))
        return cls(**kw)


@dataclass
class Eagle3Config(_HeadConfigBase):
    """EAGLE-3 head: ``fc`` fuses three target hidden states, one decoder layer, own draft-vocab ``lm_head``.

    ``aux_layers`` are HF ``hidden_states`` indices of the target (0 = the input embeddings);
    ``None`` means the default ``(2, N//2, N-3)`` once the target's layer count ``N`` is known.
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` in a config.json is read as such indices. SGLang and
    SpecForge read the same key as "output of layer i" (= index i + 1): ``eagle_mm.export`` converts when
    writing their layout; docs/serving.md has the table.
    """

    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    aux_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        _positive_int("draft_vocab_size", self.draft_vocab_size)
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        _positive_int("target_hidden_size", self.target_hidden_size)
        if self.aux_layers is not None:
            self.aux_layers = tuple(self.aux_layers)
            if len(self.aux_layers) != 3 or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.aux_layers
            ):
                raise ValueError(f"aux_layers must be three non-negative hidden_states indices, got {self.aux_layers!r}")

    @staticmethod
    def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
        """The official choice: low, middle and high hidden states of an ``num_layers``-layer target."""
        if num_layers < 4:
            raise ValueError(f"default EAGLE-3 aux layers need a target with >= 4 layers, got {num_layers}; pass aux_layers")
        return (2, num_layers // 2, num_layers - 3)

    def to_dict(self) -> dict:
        d = self._llama_fields()
        d["architectures"] = ["LlamaForCausalLMEagle3"]
        d["draft_vocab_size"] = self.draft_vocab_size
        d["target_hidden_size"] = self.target_hidden_size
        if self.aux_layers is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        kw = cls._common_kwargs(d)
        kw["draft_vocab_size"] = d.get("draft_vocab_size")
        kw["target_hidden_size"] = d.get("target_hidden_size")
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        kw["aux_layers"] = tuple(aux) if aux is not None else None
        return cls(**kw)


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the EAGLE-2 dynamic draft tree.

    depth: draft levels below the root (the last accepted token); top_k: children expanded per frontier
    node and frontier width; total_tokens: draft nodes kept after the global rerank (root excluded).
    A chain of depth d is ``TreeConfig(depth=d, top_k=1, total_tokens=d)``.
    """

    depth: int = 6
    top_k: int = 8
    total_tokens: int = 48

    def __post_init__(self) -> None:
        _positive_int("depth", self.depth)
        _positive_int("top_k", self.top_k)
        _positive_int("total_tokens", self.total_tokens)
        most = self.top_k + (self.depth - 1) * self.top_k * self.top_k
        if self.total_tokens > most:
            raise ValueError(
                f"total_tokens={self.total_tokens} exceeds the {most} nodes a tree of depth={self.depth}, "
                f"top_k={self.top_k} can draft"
            )
        if self.top_k == 1 and self.total_tokens != self.depth:
            raise ValueError(f"a chain (top_k=1) of depth {self.depth} has exactly {self.depth} nodes; got total_tokens={self.total_tokens}")

    @classmethod
    def chain(cls, depth: int) -> "TreeConfig":
        return cls(depth=depth, top_k=1, total_tokens=depth)

    @classmethod
    def coerce(cls, value) -> "TreeConfig | str":
        """What a ``tree=`` argument may be, as a TreeConfig: a TreeConfig (as is), a dict of its fields (as
        Hugging Face users pass configs), None (the defaults) or "auto" (returned as is)."""
        if value is None:
            return cls()
        if isinstance(value, cls) or (isinstance(value, str) and value == "auto"):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise TypeError(f"tree={value!r}: unknown field(s) {unknown}; a tree dict takes depth, top_k, "
                                f"total_tokens")
            return cls(**value)
        raise TypeError(f"tree={value!r}: expected a TreeConfig, a dict such as {{'depth': 5, 'top_k': 8, "
                        f"'total_tokens': 48}}, None or 'auto'")


