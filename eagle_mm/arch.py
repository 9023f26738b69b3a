"""Where each model family keeps its parts: one table, plus a generic resolver through public HF surfaces.

Text LMs need no row: ``get_decoder()`` finds the decoder stack and ``get_input_embeddings()`` /
``get_output_embeddings()`` the embeddings. VLM families are rows: they are the ones we have tested
image paths on, and the table is what error messages list.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["TargetParts", "resolve_target", "SUPPORTED_VLMS", "UNSUPPORTED"]


@dataclass(frozen=True)
class _Row:
    rope: str = "default"  # "default" (1D positions) or "mrope" (3D positions, Qwen2-VL style)


# model_type of the outer (composite) config -> facts that differ from the generic path.
SUPPORTED_VLMS: dict[str, _Row] = {
    "llava": _Row(),
    "qwen2_5_vl": _Row(rope="mrope"),
    "llama4": _Row(),
    "gemma3": _Row(),
}

# Families whose images reach the text model in ways a draft head cannot follow.
UNSUPPORTED: dict[str, str] = {
    "mllama": "images enter through cross-attention layers, not merged input embeddings",
}


@dataclass(frozen=True)
class TargetParts:
    """The pieces of a target the draft machinery touches; found once per model."""

    text_model: nn.Module  # the decoder stack (has .layers), inside a VLM its language model
    layers: nn.ModuleList
    text_config: object
    embed: nn.Module
    lm_head: nn.Module
    model_type: str
    rope: str
    is_vlm: bool

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed.weight.shape[0]


def resolve_target(model: nn.Module) -> TargetParts:
    """Find the decoder layers, embeddings and output head of an HF causal LM or VLM."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_input_embeddings"):
        raise TypeError(f"expected a Hugging Face PreTrainedModel, got {type(model).__name__}")
    model_type = getattr(config, "model_type", "")
    if model_type in UNSUPPORTED:
        raise ValueError(
            f"{type(model).__name__} (model_type {model_type!r}) is not supported: {UNSUPPORTED[model_type]}. "
            f"Supported vision-language families: {sorted(SUPPORTED_VLMS)}"
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    is_vlm = text_config is not config
    if is_vlm and model_type not in SUPPORTED_VLMS:
        raise ValueError(
            f"vision-language model {type(model).__name__} (model_type {model_type!r}) is not supported; "
            f"supported families: {sorted(SUPPORTED_VLMS)}"
        )
    text_model = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(text_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: get_decoder() has no .layers list")
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); a causal LM is needed")
    row = SUPPORTED_VLMS.get(model_type, _Row())
    return TargetParts(
        text_model=text_model,
        layers=layers,
        text_config=text_config,
        embed=model.get_input_embeddings(),
        lm_head=lm_head,
        model_type=model_type,
        rope=row.rope,
        is_vlm=is_vlm,
    )
