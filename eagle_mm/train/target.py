"""The frozen target during training: loading it (whole, or only its embeddings for dumped features),
and the no-grad forward that yields the head's input features through ``eagle_mm.hf.features.FeatureCapture``.

A target path is a model folder or a GGUF file (read through its converted folder, ``eagle_mm.hf.gguf``).
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from ..hf.features import FeatureCapture
from ..hf.gguf import model_source
from ..hf.parts import execution_device, resolve_target

__all__ = ["load_tokenizer", "load_processor", "load_target", "load_target_embeddings", "target_features",
           "target_logits"]

logger = logging.getLogger(__name__)


def _dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_source(path))


def load_processor(path):
    """The target's HF processor (image processor + tokenizer), for image rows; a ValueError if it has none."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(model_source(path))
    except Exception as e:  # AutoProcessor raises several kinds for a folder without processor files
        raise ValueError(f"the training data has images, but no processor could be loaded from {path} ({e}); save "
                         f"the target's processor there or pass processor=... to train()") from e
    if not hasattr(proc, "image_processor"):
        raise ValueError(f"the training data has images, but {path} holds no image processor (AutoProcessor gave "
                         f"a {type(proc).__name__}); save the target's processor there or pass processor=...")
    return proc


def _auto_class(config):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for VLMs that the former does not map (LLaVA)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_target(path, *, dtype: str = "auto", device=None, device_map=None):
    """The whole target, in eval mode with gradients off (it is never trained and never passed to prepare)."""
    from transformers import AutoConfig

    path = model_source(path)
    kw = {"dtype": _dtype(dtype)}
    if device_map is not None:
        kw["device_map"] = device_map
    elif device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        kw["device_map"] = {"": device}  # straight onto the device, not through host memory
    model = _auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, **kw)
    model.eval().requires_grad_(False)
    resolve_target(model)  # fail early, with its message, on an unsupported architecture
    return model


def load_target_embeddings(path, *, dtype: str = "auto", device=None):
    """The target's skeleton on the meta device with only its input embedding and lm_head loaded.

    Enough for a head trained from dumped features (it needs the embedding, and EAGLE-1 the lm_head),
    without the memory of the decoder layers, which are never run.
    """
    from transformers import AutoConfig

    path = model_source(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = _auto_class(config).from_config(config, dtype=None if dtype == "auto" else _dtype(dtype))
    # Every name of each parameter: with tied embeddings one tensor answers to both names, and the checkpoint
    # holds it under one of them (usually the embedding's).
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = lm_head.weight is embed.weight
    want = {"embed": names[id(embed.weight)]}
    if not tied:
        want["lm_head"] = names[id(lm_head.weight)]
    tensors = _read_named(Path(path), want, tie_ok=bool(getattr(config.get_text_config(), "tie_word_embeddings", False)))
    if dtype == "auto":
        dtype_ = tensors["embed"].dtype
    else:
        dtype_ = _dtype(dtype)
    embed_w = torch.nn.Parameter(tensors["embed"].to(device=device, dtype=dtype_), requires_grad=False)
    embed.load_state_dict({"weight": embed_w}, assign=True)
    head_w = embed_w if "lm_head" not in tensors else torch.nn.Parameter(
        tensors["lm_head"].to(device=device, dtype=dtype_), requires_grad=False)
    lm_head.load_state_dict({"weight": head_w}, strict=False, assign=True)
    model.eval().requires_grad_(False)
    return model


def _read_named(root: Path, want: dict[str, list[str]], tie_ok: bool) -> dict[str, torch.Tensor]:
    """role -> tensor, each read under the first of its names that the checkpoint holds."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise FileNotFoundError(f"{root} has no model.safetensors(.index.json); embeddings-only loading reads "
                                f"safetensors checkpoints")
    out = {}
    for role, keys in want.items():
        key = next((k for k in keys if k in weight_map), None)
        if key is None:
            if role == "lm_head" and tie_ok:
                continue
            named = " or ".join(repr(k) for k in keys)
            raise ValueError(f"{root}: the target's {role} weight ({named}) is not in its checkpoint")
        with safe_open(str(root / weight_map[key]), framework="pt") as f:
            out[role] = f.get_tensor(key)
    if "lm_head" not in out and "lm_head" in want:
        out["lm_head"] = out["embed"]
    return out


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(cls) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@torch.no_grad()
def target_features(model, layers: tuple[int, ...], input_ids, attention_mask, *, with_last: bool,
                    model_inputs: dict | None = None, input_embeds: bool = False):
    """One no-grad target forward: (features (B, T, len(layers) * H), last normed hidden (B, T, H) or None).

    The hooks are the ones ``speculative_generate`` uses, so a head trains on exactly what it sees at inference.
    ``model_inputs``: extra inputs of the forward (a VLM's pixel values and the like). ``input_embeds=True``
    appends a third value, the input of decoder layer 0 (B, T, H): in a VLM the merged text and image embeddings.
    """
    parts = resolve_target(model)
    n = parts.num_layers
    indices = tuple(layers) + ((n,) if with_last else ())
    kw = {"logits_to_keep": 1} if _takes_logits_to_keep(type(model)) else {}
    with FeatureCapture(parts, indices, input_embeds=input_embeds) as cap:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kw, **(model_inputs or {}))
        feats = cap.features()  # (B, T, len(indices) * H)
        embeds = (cap.input_embeds(),) if input_embeds else ()
    if not with_last:
        return (feats, None) + embeds
    width = len(layers) * parts.hidden_size
    return (feats[..., :width], feats[..., width:]) + embeds


def target_logits(parts, hidden: torch.Tensor) -> torch.Tensor:
    """The target's fp32 logits from its last normed hidden state (final soft-capping included, as Gemma does),
    on ``hidden``'s device (the lm_head of a target split by a device_map may compute elsewhere)."""
    lm_head = parts.lm_head
    logits = lm_head(hidden.to(execution_device(lm_head), lm_head.weight.dtype)).float().to(hidden.device)
    cap = getattr(parts.text_config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
