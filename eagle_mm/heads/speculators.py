"""vLLM's ``speculators`` format: read it, write it.

What the ``speculators`` package (0.9.0) writes, e.g. with ``speculators convert``, and vLLM serves directly:
config.json holds ``speculators_model_type`` ("eagle3", or "eagle" for EAGLE-1/HASS), the decoder layer's
own config nested in ``transformer_layer_config``, the EAGLE-3 variant flags, the target's aux layer ids
(``eagle_aux_hidden_state_layer_ids``: vLLM's ids, which are HF ``hidden_states`` indices like ours for 0..N-1,
see aux_ids.py) and a ``speculators_config``
naming the verifier. Weights keep the official names except the layer: ``layers.0.*`` for EAGLE-3's
``midlayer.*``; EAGLE-1 uses ``fusion_fc.*`` for ``fc.*`` and ``transformer.*`` for ``layers.0.*``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import Eagle3Config, EagleConfig
from .atomic import atomic_dir
from .aux_ids import check_aux, engine_of, export_aux
from .base import DraftHead, Layout, register_layout
from .io import (
    CONFIG_NAME, SAFETENSORS_NAME, _check_dir, head_files, _LLAMA_LIKE, _read_config_dict, _read_weights,
    _weight_files, build_head,
)

__all__ = ["save_speculators", "load_speculators", "FORMAT_VERSION"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = "0.9.0"  # the speculators release whose files these are read and written as
# (our prefix, theirs) per head kind; every other key is the same in both.
_RENAMES = {"eagle3": (("midlayer.", "layers.0."),), "eagle": (("fc.", "fusion_fc."), ("layers.0.", "transformer."))}
_ARCHITECTURES = {"eagle3": ["Eagle3Speculator"], "eagle": ["EagleSpeculator", "LlamaDecoderLayer"]}
# EAGLE-1 speculators heads with layernorms=True (the "TTT" variant) carry norms no EagleHead has.
_EAGLE1_NORMS = ("embedding_layernorm.weight", "pre_lm_head_layernorm.weight", "transformer.input_layernorm.weight")


# ---- write ---------------------------------------------------------------------------------------
def save_speculators(head: DraftHead, path, *, target_config=None, engine_version=None) -> Path:
    """Write ``head`` in the speculators format (config.json + model.safetensors); returns the directory.

    target_config: the target's HF config; names the verifier, checks the aux layers against its layer count
    and raises ``max_position_embeddings`` to the target's, as ``speculators convert`` does. The attached
    target's (text) config when omitted. engine_version: the vLLM release to serve with (None: the newest).
    """
    if not isinstance(head, DraftHead):
        raise TypeError(f"save_speculators needs an EagleHead or Eagle3Head, got {type(head).__name__}")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"output {str(root)!r} is a file; expected a directory (it is created if missing)")
    if engine_version is not None:
        engine_of("speculators")
    if target_config is None and head._target is not None:
        target_config = head._target.text_config
    config = _config_dict(head, target_config, engine_version)
    state = {_rename(k, head.kind, to_theirs=True): v.detach().to("cpu").contiguous()
             for k, v in head.state_dict().items()}
    with atomic_dir(root, replaces=head_files) as stage:  # the old head or the new one, never a mix
        save_file(state, str(stage / SAFETENSORS_NAME), metadata={"format": "pt"})
        (stage / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    logger.info("wrote %s in the speculators format to %s", type(head).__name__, root)
    return root


def _config_dict(head: DraftHead, target_config, engine_version=None) -> dict:
    cfg, kind = head.config, head.kind
    layer = cfg.to_dict()
    for key in ("architectures", "bias", "draft_vocab_size", "target_hidden_size", "eagle_config",
                *Eagle3Config.VARIANTS):
        layer.pop(key, None)
    layer["rope_parameters"] = {"rope_theta": layer.pop("rope_theta"), **(layer.pop("rope_scaling", None) or {"rope_type": "default"})}
    layer["dtype"] = str(next(head.parameters()).dtype).removeprefix("torch.")
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    target_positions = getattr(text, "max_position_embeddings", None) or 0
    layer["max_position_embeddings"] = max(cfg.max_position_embeddings, target_positions)
    verifier = {"name_or_path": getattr(target_config, "name_or_path", None) or None,
                "architectures": list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])}
    out = {
        "architectures": _ARCHITECTURES[kind],
        "speculators_model_type": kind,
        "speculators_version": FORMAT_VERSION,
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy", "verifier": verifier,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
        },
        "transformer_layer_config": layer,
        "tie_word_embeddings": False,
        "dtype": layer["dtype"],
    }
    if kind == "eagle":
        out.update(transformer_layer_architecture="LlamaDecoderLayer", layernorms=False, fusion_bias=cfg.bias)
        return out
    aux = _aux_ids(cfg, getattr(text, "num_hidden_layers", None), engine_version)
    out.update(draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.target_hidden_size,
               eagle_aux_hidden_state_layer_ids=list(aux) if aux is not None else None,
               embed_requires_grad=False, **{name: getattr(cfg, name) for name in Eagle3Config.VARIANTS})
    return out


def _aux_ids(cfg: Eagle3Config, num_layers: int | None, engine_version=None):
    """The ids to write, checked against what vLLM captures: the head's own, or for a 4-6 layer target our
    default (the format's own default, the official (2, N//2, N-3), collides there)."""
    aux = export_aux(cfg, num_layers)
    if aux is not None:
        check_aux(aux, "speculators", num_layers=num_layers, engine_version=engine_version)
    return aux


def _rename(key: str, kind: str, *, to_theirs: bool) -> str:
    for ours, theirs in _RENAMES[kind]:
        old, new = (ours, theirs) if to_theirs else (theirs, ours)
        if key.startswith(old):
            return new + key[len(old):]
    return key


# ---- read ----------------------------------------------------------------------------------------
def load_speculators(path, target=None, *, dtype=None, device=None, strict: bool = True) -> DraftHead:
    """Load a speculators-format EAGLE-3 or EAGLE-1 head; its kind and variants come from config.json."""
    root = _check_dir(path)
    raw = _read_config_dict(root)
    config = _read_config(raw, root)
    kind = raw["speculators_model_type"]
    files = _weight_files(root)
    if files is None:
        raise FileNotFoundError(f"no weights in {root}: expected {SAFETENSORS_NAME}")
    theirs = _read_weights(files)
    if kind == "eagle" and (raw.get("layernorms") or any(k in theirs for k in _EAGLE1_NORMS)):
        raise ValueError(f"{root}: an EAGLE-1 speculators head with layernorms=true (extra embedding, input and "
                         f"pre-lm_head norms) is a variant EagleHead does not have")
    state = {_rename(k, kind, to_theirs=False): v for k, v in theirs.items()}
    return build_head(config, state, root, target=target, dtype=dtype, device=device, strict=strict)


def _read_config(raw: dict, root: Path) -> EagleConfig | Eagle3Config:
    kind = raw.get("speculators_model_type")
    if kind not in _RENAMES:
        raise ValueError(f"{root / CONFIG_NAME}: speculators_model_type={kind!r} is not an EAGLE head; "
                         f"eagle_mm reads {sorted(_RENAMES)}")
    try:
        return _config_from_speculators(raw, kind)
    except ValueError as e:
        raise ValueError(f"{root / CONFIG_NAME}: {e}") from e


def _config_from_speculators(raw: dict, kind: str) -> EagleConfig | Eagle3Config:
    layer = dict(raw.get("transformer_layer_config") or {})
    if not layer:
        raise ValueError("no transformer_layer_config: not a speculators head")
    model_type = layer.get("model_type", "llama")
    if model_type not in _LLAMA_LIKE:
        raise ValueError(f"transformer_layer_config.model_type {model_type!r} is not a Llama-style decoder layer "
                         f"(expected one of {_LLAMA_LIKE})")
    if kind == "eagle":
        layer["bias"] = bool(raw.get("fusion_bias", False))
        return EagleConfig.from_dict(layer)
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and len(aux) != 3:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {aux} fuses {len(aux)} target layers; "
                         f"Eagle3Head fuses exactly three")
    layer.update(draft_vocab_size=raw.get("draft_vocab_size"), target_hidden_size=raw.get("target_hidden_size"),
                 eagle_config={"eagle_aux_hidden_state_layer_ids": aux} if aux is not None else None)
    layer.update({name: bool(raw.get(name, False)) for name in Eagle3Config.VARIANTS})
    return Eagle3Config.from_dict(layer)


register_layout(Layout(
    "speculators", write=save_speculators, read=load_speculators,
    claims=lambda config: "speculators_model_type" in config, config=_read_config,
))
