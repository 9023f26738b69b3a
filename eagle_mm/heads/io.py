"""Draft-head checkpoints: save in the official EAGLE layouts, load ours, the official ones and, through the
layout registry (heads/base.py), every other registered layout (heads/engines.py, heads/speculators.py).

On disk a head is what the official EAGLE / EAGLE-3 releases ship (and vLLM and SGLang read):
``config.json`` with llama-style fields plus ``model.safetensors`` with the head's own tensors under
the official key names. Loading also accepts sharded safetensors and ``pytorch_model.bin``, and skips
what official files carry but the head never owns: ``embed_tokens.weight`` (the target's embedding is
used) and rotary ``inv_freq`` (recomputed from ``rope_theta``).

A head this library saves records the sha256 of its weight file in ``config.json`` (``eagle_mm_weights_sha256``),
and loading checks it: safetensors has no checksum, so a flipped byte in a tensor would load without a word. Heads
from elsewhere have no such field and load as before.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..hf.parts import execution_device, resolve_target
from ..config import Eagle3Config, EagleConfig
from .atomic import atomic_dir, check_sha256, file_sha256
from .base import DraftHead, Layout, claiming_layout, head_class, register_layout
from .validate import check_head_files

__all__ = ["save_head", "load_head", "load_config", "build_head"]

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"
TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
SHA256_KEY = "eagle_mm_weights_sha256"  # in config.json: weight file name -> sha256 of its bytes, as saved

# Official heads say "llama" even for Qwen targets; EAGLE-1 heads of other families keep the target's
# model_type. All of these describe the one Llama-style decoder layer our heads build.
_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_SHARED_EMBED_KEY = "embed_tokens.weight"
# transformers < 4.31 persisted the rotary buffer, so old EAGLE-1 files may hold it.
_INV_FREQ_SUFFIX = "rotary_emb.inv_freq"


# ---- save ----------------------------------------------------------------------------------------
def save_head(head: DraftHead, path, *, safe_serialization: bool = True) -> None:
    """Write ``config.json`` and the head's own weights (``model.safetensors``, or ``pytorch_model.bin``)."""
    if not isinstance(head, DraftHead):
        raise TypeError(f"save_head needs an EagleHead or Eagle3Head, got {type(head).__name__}")
    root = Path(path)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    _refuse_target_tensors(head, state)
    dtype = next(head.parameters()).dtype
    config = head.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    name = SAFETENSORS_NAME if safe_serialization else TORCH_NAME
    # The whole head is written beside the old one and swapped in: a reader never sees new weights under an old
    # config.json, and a failed save leaves the old head as it was.
    with atomic_dir(root, replaces=head_files) as stage:
        if safe_serialization:
            save_file(state, stage / name, metadata={"format": "pt"})
        else:
            torch.save(state, stage / name)
        config[SHA256_KEY] = {name: file_sha256(stage / name)}
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        (stage / CONFIG_NAME).write_text(text, encoding="utf-8")
    logger.info("saved %s (%d tensors, %s) to %s", type(head).__name__, len(state), config["torch_dtype"], root)


def _refuse_target_tensors(head: DraftHead, state: dict) -> None:
    """The target's embedding / lm_head must never land in a head checkpoint (they are the target's)."""
    if head._target is None:
        return
    foreign = {head._target.embed.weight.data_ptr(), head._target.lm_head.weight.data_ptr()}
    shared = [k for k, v in head.state_dict().items() if v.data_ptr() in foreign]
    if shared:
        raise RuntimeError(f"refusing to save {shared}: these tensors belong to the target model, not the head")


def head_files(root: Path) -> set[str]:
    """Names in ``root`` that a save replaces: config.json and every weight file or index of any format."""
    names = {CONFIG_NAME, SAFETENSORS_NAME, TORCH_NAME}
    for index_name in (SAFETENSORS_INDEX_NAME, TORCH_INDEX_NAME):
        index = root / index_name
        if index.is_file():
            names.add(index_name)
            try:
                names.update(_index_map(index).values())
            except ValueError as e:
                logger.warning("not dropping the shards of %s: %s", index, e)
    return names


# ---- config --------------------------------------------------------------------------------------
def load_config(path) -> EagleConfig | Eagle3Config:
    """The head config in ``path/config.json``; the kind (EAGLE-1 or EAGLE-3) is told from it and the weights."""
    root = _check_dir(path)
    raw = _read_config_dict(root)
    other = claiming_layout(raw)
    if other is not None and other.config is not None:
        return other.config(raw, root)
    files = _weight_files(root)
    return _config_from_dict(raw, _weight_keys(files) if files else None, root)


def _config_from_dict(raw: dict, keys, root: Path) -> EagleConfig | Eagle3Config:
    kind = _detect_kind(raw, keys, root)
    d = dict(raw)
    if keys is not None:
        # Fields the official code defaults (bias) or the family implies (Qwen2 q/k/v bias) follow the weights.
        if kind == "eagle" and "bias" not in d:
            d["bias"] = "fc.bias" in keys
        if d.get("attention_bias") is None:
            d["attention_bias"] = any(k.endswith("self_attn.q_proj.bias") for k in keys)
    cls = Eagle3Config if kind == "eagle3" else EagleConfig
    try:
        return cls.from_dict(d)
    except ValueError as e:
        raise ValueError(f"{root / CONFIG_NAME}: {e}") from e


def _detect_kind(raw: dict, keys, root: Path) -> str:
    """'eagle' or 'eagle3'; ValueError when the files are not a draft head."""
    where = root / CONFIG_NAME
    not_head = f"{where} is not an EAGLE/EAGLE-3 head config"
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in _LLAMA_LIKE:
        raise ValueError(f"{not_head}: model_type {model_type!r} is not a Llama-style decoder (expected one of {_LLAMA_LIKE})")
    n_layers = raw.get("num_hidden_layers", 1)
    if n_layers != 1:
        raise ValueError(f"{not_head}: num_hidden_layers={n_layers}, but a draft head has exactly one decoder layer")
    archs = [str(a) for a in raw.get("architectures") or []]
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    # The official EAGLE-3 training config says LlamaForCausalLM; draft_vocab_size still marks it.
    says3 = any("eagle3" in a.lower() for a in archs) or "draft_vocab_size" in raw or aux is not None
    if keys is not None:
        has3 = any(k.startswith("midlayer.") for k in keys)
        has1 = "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys)
        if has3 and not has1:
            return "eagle3"
        if has1 and not has3:
            if says3:
                raise ValueError(
                    f"{where} describes an EAGLE-3 head (architectures={archs}, draft_vocab_size="
                    f"{raw.get('draft_vocab_size')}) but the weights have the EAGLE-1 layout (fc + layers.0.*)"
                )
            return "eagle"
        sample = sorted(keys)[:8]
        raise ValueError(
            f"unknown weight layout in {root}: not an EAGLE/EAGLE-3 head. Expected 'midlayer.*' (EAGLE-3) or "
            f"'fc.weight' + 'layers.0.*' (EAGLE-1) keys; found {len(keys)} keys, e.g. {sample}"
        )
    if says3:
        return "eagle3"
    if "bias" in raw and all(a.endswith("ForCausalLM") for a in archs):
        return "eagle"
    raise ValueError(
        f"{not_head}: no Eagle3 architecture, draft_vocab_size or EAGLE-1 'bias' field "
        f"(architectures={archs}), and no weights to tell the kind from"
    )


# ---- load ----------------------------------------------------------------------------------------
def load_head(
    path,
    target: nn.Module | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    strict: bool = True,
) -> DraftHead:
    """Load an EAGLE-1/2 or EAGLE-3 head from a local directory: ours, an official release, or any layout
    another module registered (vLLM / SGLang exports, the speculators format), told from config.json.

    dtype: the checkpoint's unless given. target: attached (its shapes checked; ``speculative_generate`` casts the
    head to the target's dtype) and, unless ``device`` is given, the head moves to its embedding's device. strict:
    unexpected weight keys are an error.
    """
    check_head_files(path, names=(CONFIG_NAME, SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME, TORCH_NAME, TORCH_INDEX_NAME),
                     weight_files=_weight_files,
                     config_of=lambda root, keys: _config_from_dict(_read_config_dict(root), keys, root))
    root = _check_dir(path)
    raw = _read_config_dict(root)
    other = claiming_layout(raw)
    if other is not None:
        return other.read(root, target, dtype=dtype, device=device, strict=strict)
    files = _weight_files(root)
    if files is None:
        raise FileNotFoundError(
            f"no weights in {root}: expected {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME} or {TORCH_NAME}"
        )
    if SHA256_KEY in raw:  # saved by this library; a head from elsewhere has no record
        check_sha256({f.name: f for f in files}, raw[SHA256_KEY], root / CONFIG_NAME,
                     f"copy or save the head again (to load it as it is, delete {SHA256_KEY!r} from its config.json)")
    state = _read_weights(files)
    config = _config_from_dict(raw, set(state), root)
    return build_head(config, state, root, target=target, dtype=dtype, device=device, strict=strict)


def build_head(config, state: dict, root: Path, *, target=None, dtype=None, device=None, strict: bool = True) -> DraftHead:
    """The head for ``config`` holding ``state`` (official key names), checked; every layout's reader ends here."""
    head = head_class("eagle3" if isinstance(config, Eagle3Config) else "eagle")(config)
    state = _drop_unowned(state, config, target, root)
    _check_state(head, state, strict, root)

    load_dtype = _resolve_dtype(dtype, state, root)
    own = head.state_dict()
    # Float tensors take the load dtype; ids (d2t long, t2d bool) keep the head's integer dtypes.
    state = {
        k: v.to(load_dtype) if v.is_floating_point() else v.to(own[k].dtype) for k, v in state.items() if k in own
    }
    # assign=True adopts the tensors as they are; rotary inv_freq (not in the file) stays fp32.
    head.load_state_dict(state, strict=False, assign=True)
    if target is not None:
        head.attach(target, cast=False)  # the dtype read stays (bit-exact); decoding casts to the target's
        if device is None:
            device = execution_device(head.target_parts.embed)
    if device is not None:
        head.to(device)
    head.eval()
    logger.info("loaded %s from %s (%d tensors, %s)", type(head).__name__, root, len(state), load_dtype)
    return head


def _drop_unowned(state: dict, config, target: nn.Module | None, root: Path) -> dict:
    """Remove the shared embedding and rotary buffers; check the embedding's shape on the way."""
    out = {}
    for key, tensor in state.items():
        if key.endswith(_INV_FREQ_SUFFIX):
            logger.debug("ignoring %s from %s: recomputed from rope_theta", key, root)
        elif key == _SHARED_EMBED_KEY:
            _check_embed(tensor, config, target, root)
        else:
            out[key] = tensor
    return out


def _check_embed(tensor: torch.Tensor, config, target: nn.Module | None, root: Path) -> None:
    shape = tuple(tensor.shape)
    expected = (config.vocab_size, config.hidden_size)
    if shape != expected:
        raise ValueError(f"{root}: {_SHARED_EMBED_KEY} has shape {shape}, but the config says vocab x hidden = {expected}")
    if target is not None:
        emb = tuple(resolve_target(target).embed.weight.shape)
        if emb != shape:
            raise ValueError(
                f"{root}: {_SHARED_EMBED_KEY} in the checkpoint is {shape} (vocab x hidden) but the target's "
                f"input embedding is {emb}: this head was trained for a different target"
            )
    logger.debug("ignoring %s from %s: the target's embedding is used", _SHARED_EMBED_KEY, root)


def _check_state(head: DraftHead, state: dict, strict: bool, root: Path) -> None:
    own = head.state_dict()
    optional = set()
    cfg = head.config
    if isinstance(cfg, Eagle3Config) and cfg.draft_vocab_size == cfg.vocab_size:
        # Official EAGLE-3 drops d2t/t2d when the vocabularies agree; the head's identity map is right then.
        optional = {"d2t", "t2d"}
    missing = sorted(k for k in own if k not in state and k not in optional)
    if missing:
        raise ValueError(f"{root}: checkpoint lacks {len(missing)} weight(s) of {type(head).__name__}: {missing}")
    unexpected = sorted(k for k in state if k not in own)
    if unexpected and strict:
        raise ValueError(
            f"{root}: checkpoint has {len(unexpected)} weight(s) {type(head).__name__} does not use: {unexpected} "
            f"(pass strict=False to ignore them)"
        )
    if unexpected:
        logger.warning("ignoring weights %s from %s: not part of %s", unexpected, root, type(head).__name__)
    bad = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs head {tuple(own[k].shape)}"
        for k in sorted(state)
        if k in own and state[k].shape != own[k].shape
    ]
    if bad:
        raise ValueError(f"{root}: shape mismatch between checkpoint and config.json: " + "; ".join(bad))
    if "d2t" in state:
        target_ids = state["d2t"].long() + torch.arange(state["d2t"].numel())
        if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size):
            raise ValueError(
                f"{root}: d2t maps draft ids to target ids in [{int(target_ids.min())}, {int(target_ids.max())}], "
                f"outside the target vocabulary [0, {cfg.vocab_size})"
            )


def _resolve_dtype(dtype, state: dict, root: Path) -> torch.dtype:
    if dtype is not None:
        resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(f"dtype must be a floating torch dtype (e.g. torch.bfloat16), got {dtype!r}")
        return resolved
    sizes = Counter()
    for v in state.values():
        if v.is_floating_point():
            sizes[v.dtype] += v.numel()
    if len(sizes) > 1:
        logger.warning("%s mixes float dtypes %s; loading all as %s", root, dict(sizes), sizes.most_common(1)[0][0])
    return sizes.most_common(1)[0][0] if sizes else torch.float32


# ---- files ---------------------------------------------------------------------------------------
def _check_dir(path) -> Path:
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"draft head directory {str(path)!r} does not exist (only local directories are read; "
            f"download hub checkpoints first)"
        )
    if not root.is_dir():
        raise ValueError(f"{str(path)!r} is a file; expected a directory with {CONFIG_NAME} and weights")
    return root


def _read_config_dict(root: Path) -> dict:
    file = root / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{root} has no {CONFIG_NAME}; it is not a saved draft head")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _weight_files(root: Path) -> list[Path] | None:
    """The weight files in load order of preference, or None when there are none."""
    if (root / SAFETENSORS_NAME).is_file():
        return [root / SAFETENSORS_NAME]
    for index_name in (SAFETENSORS_INDEX_NAME, TORCH_INDEX_NAME):
        index = root / index_name
        if index.is_file():
            shards = [root / n for n in dict.fromkeys(_index_map(index).values())]
            absent = [s.name for s in shards if not s.is_file()]
            if absent:
                raise FileNotFoundError(f"{index} lists shard(s) {absent} that are not in {root}")
            return shards
    if (root / TORCH_NAME).is_file():
        return [root / TORCH_NAME]
    return None


def _index_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{index} is not a weight index (JSON object with 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map' object")
    outside = sorted({n for n in weight_map.values() if Path(n).name != n})
    if outside:
        raise ValueError(f"{index} points at files outside its directory: {outside}")
    return weight_map


def _weight_keys(files: list[Path]) -> set[str]:
    """Tensor names without reading the tensors where the format allows."""
    keys: set[str] = set()
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                keys.update(f.keys())
        else:
            keys.update(_read_torch_file(file))
    return keys


def _read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(file)) if file.suffix == ".safetensors" else _read_torch_file(file)
        dup = sorted(set(part) & set(state))
        if dup:
            raise ValueError(f"{file} repeats tensor(s) {dup} already read from another shard")
        state.update(part)
    return state


def _read_torch_file(file: Path) -> dict[str, torch.Tensor]:
    # weights_only: a .bin is a pickle, and a downloaded pickle must not run code.
    obj = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError(f"{file} holds a {type(obj).__name__}, expected a state dict of tensors")
    bad = sorted(str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(f"{file} has entries that are not named tensors: {bad[:8]}")
    return obj


register_layout(Layout("eagle", write=save_head, read=load_head, claims=lambda config: False))
