"""Configuration dataclasses: draft heads and draft trees.

One dataclass per config, validated in ``__post_init__``; every default lives here once.
The head configs read and write the official EAGLE ``config.json`` layouts (llama-style fields).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["EagleConfig", "Eagle3Config", "TreeConfig", "bound_tree"]

logger = logging.getLogger(__name__)

# "mrope": a VLM head's multimodal RoPE (Qwen2-VL family), frequencies as "default". The head is given 1D
# positions; with the three axes equal, as at every text position, M-RoPE is exactly that 1D RoPE.
_ROPE_TYPES = ("default", "linear", "llama3", "mrope")


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
        # Kept when it changes the frequencies, or names M-RoPE sections (VLM heads), so a save writes it back.
        if scaling and (scaling.get("rope_type", scaling.get("type", "default")) != "default"
                        or "mrope_section" in scaling):
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
    ``None`` means ``default_aux_layers(N)`` (the official ``(2, N//2, N-3)`` unless those collide) once the
    target's layer count ``N`` is known.
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` in a config.json is read as such indices. SGLang and
    SpecForge read the same key as "output of layer i" (= index i + 1): ``eagle_mm.heads.engines`` converts
    when writing their layout; docs/serving.md has the table.
    """

    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    aux_layers: tuple[int, ...] | None = None
    # Variants of the EAGLE-3 head in circulation (the names of vLLM's speculators format; all off in the
    # official head). norm_before_residual: the residual around attention is hidden_norm(h), not h.
    norm_before_residual: bool = False
    # norm_before_fc: one RMSNorm over the concatenated target features (3T wide) before fc (gpt-oss heads).
    norm_before_fc: bool = False
    # fc_norm: one RMSNorm per target feature (T wide each) before the concatenation and fc.
    fc_norm: bool = False
    # norm_output: the head feeds back norm(h) instead of h when drafting deeper, and logits = lm_head(norm(h))
    # as usual (EAGLE 3.1).
    norm_output: bool = False

    VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.VARIANTS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc (one norm over the concatenated features) and fc_norm (one norm per "
                             "feature) exclude each other; set at most one")
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
        """Low, middle and high hidden states of an ``num_layers``-layer target: the official ``(2, N//2, N-3)``.

        On targets of 4 to 6 layers the official indices collide (6 layers: 2, 3, 3), and the official capture
        then fails on the fc width; there the default is ``(1, N//2, N-1)`` instead (6 layers: 1, 3, 5),
        three distinct indices that vLLM and SGLang can capture too.
        """
        if num_layers < 4:
            raise ValueError(f"default EAGLE-3 aux layers need a target with >= 4 layers, got {num_layers}; pass "
                             f"aux_layers (eagle-mm train: --aux-layers), three hidden_states indices in [0, "
                             f"{num_layers}]")
        official = (2, num_layers // 2, num_layers - 3)
        return official if len(set(official)) == 3 else (1, num_layers // 2, num_layers - 1)

    def to_dict(self) -> dict:
        d = self._llama_fields()
        d["architectures"] = ["LlamaForCausalLMEagle3"]
        d["draft_vocab_size"] = self.draft_vocab_size
        d["target_hidden_size"] = self.target_hidden_size
        if self.aux_layers is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
        for name in self.VARIANTS:  # the official layout has no such keys; an official head needs none
            if getattr(self, name):
                d[name] = True
        return d

    def variants(self) -> tuple[str, ...]:
        """Names of the variant flags this head sets (empty for the official EAGLE-3 head)."""
        return tuple(name for name in self.VARIANTS if getattr(self, name))

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        kw = cls._common_kwargs(d)
        kw["draft_vocab_size"] = d.get("draft_vocab_size")
        kw["target_hidden_size"] = d.get("target_hidden_size")
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        kw["aux_layers"] = tuple(aux) if aux is not None else None
        kw.update({name: d[name] for name in cls.VARIANTS if d.get(name) is not None})
        return cls(**kw)


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the EAGLE-2 dynamic draft tree.

    depth: draft levels below the root (the last accepted token); top_k: children expanded per frontier
    node and frontier width; total_tokens: draft nodes kept after the global rerank (root excluded).
    A chain of depth d is ``TreeConfig(depth=d, top_k=1, total_tokens=d)``. ``TreeConfig.none()`` (depth 0) drafts
    nothing: each cycle verifies the root alone, one token per target forward, as ``generate`` decodes.

    Bounds: depth <= ``MAX_DEPTH`` (each level is one head forward per cycle, and deeper drafts are
    almost never accepted) and total_tokens <= ``MAX_TOTAL_TOKENS`` (with the root, one verify row of at most 1024
    nodes, what the verify kernels hold in one program). A decode also clamps the tree to what it can commit
    (``bound_tree``).
    """

    depth: int = 6
    top_k: int = 8
    total_tokens: int = 48

    MAX_DEPTH: ClassVar[int] = 64
    MAX_TOTAL_TOKENS: ClassVar[int] = 1023

    def __post_init__(self) -> None:
        if self.depth == 0 and not isinstance(self.depth, bool):
            if (self.top_k, self.total_tokens) != (1, 0):
                raise ValueError(f"a tree of depth 0 drafts nothing: it takes top_k=1, total_tokens=0 "
                                 f"(TreeConfig.none()), got top_k={self.top_k!r}, total_tokens={self.total_tokens!r}")
            return
        _positive_int("depth", self.depth)
        _positive_int("top_k", self.top_k)
        _positive_int("total_tokens", self.total_tokens)
        if self.depth > self.MAX_DEPTH:
            raise ValueError(f"tree depth={self.depth} exceeds TreeConfig.MAX_DEPTH={self.MAX_DEPTH}; use a depth of "
                             f"at most {self.MAX_DEPTH} (drafts beyond ~10 tokens are rarely accepted)")
        if self.total_tokens > self.MAX_TOTAL_TOKENS:
            raise ValueError(f"total_tokens={self.total_tokens} exceeds TreeConfig.MAX_TOTAL_TOKENS="
                             f"{self.MAX_TOTAL_TOKENS}; use at most {self.MAX_TOTAL_TOKENS} draft nodes")
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
    def none(cls) -> "TreeConfig":
        """No draft: every cycle verifies the root alone and commits the target's own next token."""
        return cls(depth=0, top_k=1, total_tokens=0)

    @property
    def drafts(self) -> bool:
        """Whether this tree drafts anything (False for ``TreeConfig.none()``)."""
        return self.depth > 0

    def fits(self, capacity: "TreeConfig") -> bool:
        """Whether a decode sized for ``capacity`` can run this tree: no deeper, wider or larger."""
        return (self.depth <= capacity.depth and self.top_k <= capacity.top_k
                and self.total_tokens <= capacity.total_tokens)

    @classmethod
    def reference(cls, device) -> "TreeConfig":
        """A fixed tree for numbers that must compare across runs and calls (training's evaluation, the demos): a chain
        of 3 on a CPU, where every verified node costs compute, ``TreeConfig()`` on a GPU. ``device``: a
        ``torch.device`` or its name. The default call chooses its own tree from what it measures (``decode.chooser``)."""
        return cls.chain(3) if str(device).split(":")[0] == "cpu" else cls()

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


def bound_tree(tree: TreeConfig, max_new_tokens: int) -> TreeConfig:
    """``tree`` clamped to what a decode of ``max_new_tokens`` tokens can commit: depth <= max_new_tokens (a cycle
    commits at most depth + 1 tokens) and total_tokens <= what that depth can hold. Logs one line when it clamps."""
    depth = min(tree.depth, max(1, max_new_tokens))
    if depth == tree.depth:
        return tree
    k = tree.top_k
    total = depth if k == 1 else min(tree.total_tokens, k + (depth - 1) * k * k)
    bounded = TreeConfig(depth=depth, top_k=k, total_tokens=total)
    logger.info("draft tree %s clamped to %s: max_new_tokens=%d commits at most that deep", tree, bounded,
                max_new_tokens)
    return bounded
