"""Where each model family keeps its parts: one table, plus a generic resolver through public HF surfaces.

Text LMs need no row: ``get_decoder()`` finds the decoder stack and ``get_input_embeddings()`` /
``get_output_embeddings()`` the embeddings. VLM families are rows: they are the ones we have tested
image paths on, and the table is what error messages list.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["TargetParts", "resolve_target", "execution_device", "SUPPORTED_VLMS", "UNSUPPORTED"]


@dataclass(frozen=True)
class _Row:
    rope: str = "default"  # "default" (1D positions) or "mrope" (3D positions from the image grids, Qwen-VL style)
    decoder: str | None = None  # dotted path to the decoder stack where get_decoder() stops short of it


# model_type of the outer (composite) config -> facts that differ from the generic path.
SUPPORTED_VLMS: dict[str, _Row] = {
    "llava": _Row(),
    "qwen2_5_vl": _Row(rope="mrope"),
    # Interleaved M-RoPE (the same 3D position ids); deepstack image features enter the first layers' outputs.
    "qwen3_vl": _Row(rope="mrope"),
    "qwen3_vl_moe": _Row(rope="mrope"),
    # get_decoder() returns the Llama4ForCausalLM wrapper; its decoder stack is one level down.
    "llama4": _Row(decoder="language_model.model"),
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
    image_token_id: int | None = None  # the placeholder token a VLM's prompt repeats per image feature
    embed_device: torch.device | None = None  # where the input embeddings compute (``execution_device``)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed.weight.shape[0]

    @property
    def position_limit(self) -> int | None:
        """Cache length up to which the forward is exact under tree verification, or None (no limit).

        Llama 4's attention temperature tuning on its NoPE layers reads each query's position from the cache
        length, not from ``position_ids``; its scale stays 1 below ``floor_scale - 1`` cache entries, where the
        tree's positions and the cache's agree on every scale.
        """
        tc = self.text_config
        nope = 0 in (getattr(tc, "no_rope_layers", None) or ())
        if nope and getattr(tc, "attn_temperature_tuning", False):
            return int(tc.floor_scale) - 1
        return None


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
    row = SUPPORTED_VLMS.get(model_type, _Row())
    text_model = _decoder(model, row)
    layers = getattr(text_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: get_decoder() has no .layers list")
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); a causal LM is needed")
    embed = model.get_input_embeddings()
    return TargetParts(
        text_model=text_model,
        layers=layers,
        text_config=text_config,
        embed=embed,
        lm_head=lm_head,
        model_type=model_type,
        rope=row.rope,
        is_vlm=is_vlm,
        image_token_id=getattr(config, "image_token_id", None) if is_vlm else None,
        embed_device=execution_device(embed),
    )


def _decoder(model: nn.Module, row: _Row):
    if row.decoder is None:
        return model.get_decoder() if hasattr(model, "get_decoder") else None
    module = model
    for name in row.decoder.split("."):
        module = getattr(module, name, None)
    return module


def execution_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its accelerate hook's execution device when a ``device_map`` placed it, else
    the device of its first parameter or buffer (CPU for a module with neither).

    Under a device_map, a module offloaded to the CPU or disk keeps its weights on "meta" between forwards
    and runs on the hook's execution device (the main GPU), so ``weight.device`` is not where it computes.
    """
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):  # SequentialHook or one hook
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            if isinstance(dev, int):  # accelerate's spelling of accelerator device `dev`
                kind = torch.accelerator.current_accelerator()
                return torch.device(kind.type if kind is not None else "cuda", dev)
            return torch.device(dev)
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")
