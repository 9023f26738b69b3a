"""The layouts vLLM and SGLang load: write a head in them, read any of them back, print the serve command.

Three on-disk layouts of one head: ``eagle`` (the official EAGLE release layout, what ``save_head``
writes), ``vllm`` and ``sglang``. What each engine's loader reads (architecture names, config fields,
weight keys, aux-layer convention) is tabled, with the source file of each fact, in docs/serving.md.
Every layout starts from ``save_head``'s files; an engine layout then changes only what that engine
reads differently, and records in config.json under ``eagle_mm_export`` what it changed, so
``load_exported`` restores the head bit for bit. Both engines build the draft config with
transformers, which keeps unknown keys as inert attributes, so the record changes nothing there.
"""
from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from ..hf.parts import execution_device
from ..config import Eagle3Config, EagleConfig, TreeConfig
from .aux_ids import aux_from_engine, aux_notes, check_aux, engine_ids, engine_of, export_aux, sglang_rule
from .base import DraftHead, Layout, get_layout, head_class, register_layout
from .atomic import atomic_dir
from .io import head_files, load_head, save_head

__all__ = ["LAYOUTS", "export_head", "load_exported", "detect_layout", "serving_command", "export_notes"]

logger = logging.getLogger(__name__)

LAYOUTS = ("eagle", "vllm", "sglang")
MARKER = "eagle_mm_export"
_FORMAT = 2  # 2: an sglang layout's ids may follow either SGLang rule; the record names our aux layers
_CONFIG = "config.json"
_WEIGHTS = "model.safetensors"

# (layout, head kind) -> the architecture name the loader dispatches on. vLLM's EAGLEConfig renames
# LlamaForCausalLM to EagleLlamaForCausalLM itself (method "eagle"), so its EAGLE-1 name is the official one.
_ARCH = {
    ("eagle", "eagle"): "LlamaForCausalLM",
    ("eagle", "eagle3"): "LlamaForCausalLMEagle3",
    ("vllm", "eagle"): "LlamaForCausalLM",
    ("vllm", "eagle3"): "LlamaForCausalLMEagle3",
    ("sglang", "eagle"): "LlamaForCausalLMEagle",
    ("sglang", "eagle3"): "LlamaForCausalLMEagle3",
}
# How each engine reads the aux-layer ids, and the ids written for it: heads/aux_ids.py.
_VLLM_AUX_KEY = "eagle_aux_hidden_state_layer_ids"  # vLLM reads it top-level; SGLang inside eagle_config
_LAYER_PREFIX = {"eagle": "layers.0.", "eagle3": "midlayer."}
_METHOD = {"vllm": {"eagle": "eagle", "eagle3": "eagle3"}, "sglang": {"eagle": "EAGLE", "eagle3": "EAGLE3"}}


# ---- export ----------------------------------------------------------------------------------------
def export_head(head: DraftHead, path, layout: str = "eagle", *, target_config=None, engine_version=None) -> Path:
    """Write ``head`` to ``path`` (config.json + model.safetensors) in the layout an engine loads.

    target_config: the target's HF config (a VLM's text config is found); it checks the head's sizes,
    that every aux layer is one the engine can capture, and raises ``max_position_embeddings`` to the
    target's. Taken from the attached target when omitted. engine_version: the vLLM (vllm, speculators
    layouts) or SGLang (sglang layout) release to serve with, e.g. "0.17.1"; refuses what that release
    cannot capture. None: the newest conventions (docs/serving.md). Returns the directory.
    """
    if engine_version is not None:
        engine_of(layout)  # the eagle layout has no engine release
    if layout not in LAYOUTS:  # another registered layout (speculators); unknown names raise there
        return get_layout(layout).write(head, path, target_config=target_config, engine_version=engine_version)
    if not isinstance(head, DraftHead):
        raise TypeError(f"export_head needs an EagleHead or Eagle3Head, got {type(head).__name__}")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"output {str(root)!r} is a file; expected a directory (it is created if missing)")
    target = _target_facts(head, target_config)
    extra, changes, marker = {}, {}, {"layout": layout, "format": _FORMAT}
    if layout != "eagle":
        # Everything is checked before a byte is written.
        extra, changes, marker = _engine_changes(head, layout, target, engine_version)
    with atomic_dir(root, replaces=head_files) as stage:  # readers see the old head or the new one, never a mix
        save_head(head, stage)
        if extra:
            state = load_file(str(stage / _WEIGHTS))
            state.update(extra)
            save_file(state, str(stage / _WEIGHTS), metadata={"format": "pt"})
        config = _read_json(stage / _CONFIG)
        config.update(changes)
        config[MARKER] = marker
        (stage / _CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    logger.info("exported %s in the %s layout to %s", type(head).__name__, layout, root)
    return root


def _engine_changes(head: DraftHead, layout: str, target: "_Target", engine_version):
    """(zero tensors to add, config fields to set, marker) turning the official files into ``layout``."""
    cfg, kind = head.config, head.kind
    if cfg.hidden_act != "silu":
        raise ValueError(f"{layout}'s LlamaMLP accepts only hidden_act='silu'; this head has {cfg.hidden_act!r}")
    dtype = next(head.parameters()).dtype
    extra: dict[str, torch.Tensor] = {}
    changes: dict = {"architectures": [_ARCH[(layout, kind)]]}
    if kind == "eagle" and layout == "vllm" and cfg.bias:
        raise ValueError(
            "vLLM's EagleLlamaForCausalLM (vllm/model_executor/models/llama_eagle.py) builds fc without a bias, "
            "but this head has fc.bias (EagleConfig.bias=True); train the head with bias=False, or export "
            "with layout='sglang', whose EAGLE-1 fc has a bias"
        )
    if kind == "eagle" and layout == "sglang":
        # SGLang's fc always has a bias; its Llama layer reads `bias` as the attention bias, so it must be false.
        changes["bias"] = False
        if not cfg.bias:
            extra["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=dtype)
    if cfg.attention_bias:
        if kind == "eagle3" and layout == "sglang":
            raise ValueError(
                "SGLang's EAGLE-3 layer (python/sglang/srt/models/llama_eagle3.py) builds qkv_proj without a "
                "bias, but this head has attention_bias=True; export with layout='vllm'"
            )
        # Both engines give o_proj a bias whenever attention_bias is set; ours has none, so it is exactly 0.
        extra[_LAYER_PREFIX[kind] + "self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size, dtype=dtype)
    if kind == "eagle3":
        _check_variants(cfg, layout)
        if cfg.norm_before_residual:
            changes["norm_before_residual"] = True  # vLLM's EAGLE-3 layer reads it from the draft config
        if layout == "sglang" and cfg.target_hidden_size != cfg.hidden_size:
            raise ValueError(
                f"SGLang shares the target's embedding only when target_hidden_size == hidden_size "
                f"({cfg.target_hidden_size} != {cfg.hidden_size}), and this head ships no embedding"
            )
        aux = export_aux(cfg, target.num_layers)
        if aux is not None:
            check_aux(aux, layout, num_layers=target.num_layers, engine_version=engine_version)
            rule = sglang_rule(architectures=target.architectures, model_type=target.model_type,
                               engine_version=engine_version)
            ids = engine_ids(aux, layout, rule=rule)
            if layout == "vllm":
                changes[_VLLM_AUX_KEY] = ids
            else:
                changes["eagle_config"] = {_VLLM_AUX_KEY: ids, "use_aux_hidden_state": True}
    marker = {"layout": layout, "format": _FORMAT, "zero_padded": sorted(extra)}
    if kind == "eagle3":  # the ids may follow either SGLang rule, or be a default: read back from here
        marker["aux_layers"] = list(cfg.aux_layers) if cfg.aux_layers is not None else None
    if target.max_positions and target.max_positions > cfg.max_position_embeddings:
        # Engines size the draft's rotary cache from this field; older releases index past it.
        changes["max_position_embeddings"] = target.max_positions
        marker["restore"] = {"max_position_embeddings": cfg.max_position_embeddings}
    return extra, changes, marker


# EAGLE-3 variants each engine's own layout expresses; the speculators layout expresses them all.
_ENGINE_VARIANTS = {"vllm": ("norm_before_residual",), "sglang": ()}


def _check_variants(cfg: Eagle3Config, layout: str) -> None:
    unsupported = [name for name in cfg.variants() if name not in _ENGINE_VARIANTS[layout]]
    if unsupported:
        raise ValueError(
            f"the {layout} layout cannot express the EAGLE-3 variant(s) {unsupported} of this head (its loader "
            f"has no such flag); export with layout='speculators', which vLLM loads and which names every variant"
        )


class _Target(NamedTuple):
    """What an export needs to know of the target; None where it is unknown."""

    num_layers: int | None = None
    max_positions: int | None = None
    architectures: tuple[str, ...] = ()
    model_type: str | None = None


def _target_facts(head: DraftHead, target_config) -> _Target:
    """The target's facts, checking the head's sizes against it; all unknown without a target."""
    if target_config is None:
        try:
            parts = head.target_parts
        except RuntimeError:
            return _Target()
        text, outer = parts.text_config, None
        model_type = parts.model_type
    else:
        get_text = getattr(target_config, "get_text_config", None)
        text, outer = (get_text() if callable(get_text) else target_config), target_config
        model_type = getattr(target_config, "model_type", None)
    cfg = head.config
    width = cfg.target_hidden_size if isinstance(cfg, Eagle3Config) else cfg.hidden_size
    for name, ours, theirs in (("hidden size", width, getattr(text, "hidden_size", None)),
                               ("vocab_size", cfg.vocab_size, getattr(text, "vocab_size", None))):
        if theirs is not None and ours != theirs:
            raise ValueError(f"head {name} {ours} does not match the target's {theirs}: this head is for another target")
    architectures = tuple(getattr(outer if outer is not None else text, "architectures", None) or ())
    return _Target(getattr(text, "num_hidden_layers", None), getattr(text, "max_position_embeddings", None),
                   architectures, model_type)


def export_notes(head: DraftHead, layout: str, *, target_config=None, engine_version=None) -> list[str]:
    """What exporting ``head`` to ``layout`` could not check, or what it needs of the engine's release: one
    sentence each, empty when nothing (the eagle layout and EAGLE-1/2 heads have no aux layers)."""
    if layout not in ("vllm", "sglang", "speculators") or not isinstance(head.config, Eagle3Config):
        return []
    target = _target_facts(head, target_config)
    known = bool(target.architectures) or target.model_type is not None
    return aux_notes(export_aux(head.config, target.num_layers), layout, num_layers=target.num_layers,
                     engine_version=engine_version, rule_known=known)


# ---- load back ------------------------------------------------------------------------------------
def detect_layout(config: dict) -> str:
    """The layout of a config.json dict: our record if present, else inferred from what the engines read
    ("eagle", "vllm", "sglang", or "speculators" for vLLM's speculators format)."""
    marker = config.get(MARKER)
    if isinstance(marker, dict):
        layout = marker.get("layout")
        if layout not in LAYOUTS:
            raise ValueError(f"{MARKER}.layout is {layout!r}; expected one of {LAYOUTS}")
        return layout
    if "speculators_model_type" in config:  # vLLM's speculators format (heads/speculators.py) has the key too
        return "speculators"
    if _ARCH[("sglang", "eagle")] in (config.get("architectures") or []):
        return "sglang"
    if _VLLM_AUX_KEY in config:
        return "vllm"
    # SGLang EAGLE-3 dirs (e.g. SpecForge's) look official; pass layout="sglang" to read their aux ids.
    return "eagle"


def load_exported(path, target=None, *, layout: str | None = None) -> DraftHead:
    """Load a head from any layout ``export_head`` writes, converting back exactly; layout: override detection."""
    root = _check_dir(path)
    raw = _read_json(root / _CONFIG)
    if layout is not None and layout not in LAYOUTS:
        return get_layout(layout).read(root, target)
    layout = layout or detect_layout(raw)
    if layout in ("eagle", "speculators"):
        return load_head(root, target=target)
    if not (root / _WEIGHTS).is_file():
        raise FileNotFoundError(f"{root} has no {_WEIGHTS}; {layout} layout heads are one safetensors file")
    state = load_file(str(root / _WEIGHTS))
    kind = "eagle3" if any(k.startswith("midlayer.") for k in state) else "eagle"
    config, state = _from_engine(raw, state, layout, kind, root)
    config_class = Eagle3Config if kind == "eagle3" else EagleConfig
    head = head_class(kind)(config_class.from_dict(config))
    own = head.state_dict()
    # Floats keep the file's dtype (bit-exact); ids take the head's dtypes (d2t int64, t2d bool).
    state = {k: v if v.is_floating_point() or k not in own else v.to(own[k].dtype) for k, v in state.items()}
    optional = {"d2t", "t2d"} if kind == "eagle3" and head.config.draft_vocab_size == head.config.vocab_size else set()
    missing = sorted(set(own) - set(state) - optional)
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{root} ({layout} layout): missing weights {missing}, unexpected weights {unexpected}")
    head.load_state_dict(state, strict=False, assign=True)
    if target is not None:
        head.attach(target, cast=False)  # the file's dtype stays (bit-exact); decoding casts to the target's
        head.to(execution_device(head.target_parts.embed))
    return head.eval()


def _from_engine(raw: dict, state: dict, layout: str, kind: str, root: Path):
    """Undo ``_engine_changes``: the official config dict and our state dict."""
    config = dict(raw)
    marker = config.pop(MARKER, None) or {}
    if marker.get("format", _FORMAT) > _FORMAT:
        raise ValueError(f"{root} was written by a newer eagle_mm (export format {marker['format']}); upgrade eagle_mm")
    state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}  # the target's, never the head's
    padded = marker.get("zero_padded")
    if padded is None:  # not ours: an o_proj bias our heads cannot hold must be zero to be dropped
        padded = [k for k in state if k.endswith("self_attn.o_proj.bias")]
    for key in padded:
        tensor = state.pop(key, None)
        if tensor is None:
            raise ValueError(f"{root}: config lists padded tensor {key!r} but the weights lack it")
        if torch.count_nonzero(tensor):
            raise ValueError(f"{root}: {key} is not all zeros; eagle_mm heads have no such parameter")
    config.update(marker.get("restore", {}))
    config["architectures"] = [_ARCH[("eagle", kind)]]
    if kind == "eagle":
        config["bias"] = "fc.bias" in state
        return config, state
    eagle_config = dict(config.pop("eagle_config", None) or {})
    if eagle_config.get("use_aux_hidden_state", True) is False:
        raise ValueError(
            f"{root}: eagle_config.use_aux_hidden_state is false; eagle_mm's EAGLE-3 head always fuses aux states"
        )
    if layout == "vllm":
        ids = config.pop(_VLLM_AUX_KEY, None)
        nested = eagle_config.get(_VLLM_AUX_KEY)
        if nested is not None and ids is not None and list(nested) != list(ids):
            logger.warning("%s: vLLM reads top-level %s=%s and ignores eagle_config's %s", root, _VLLM_AUX_KEY, ids, nested)
    else:
        ids = eagle_config.get(_VLLM_AUX_KEY)
    if "aux_layers" in marker:  # ours: the ids may follow either SGLang rule, or be a default we wrote
        if marker["aux_layers"] is not None:
            config["eagle_config"] = {_VLLM_AUX_KEY: list(marker["aux_layers"])}
    elif ids is not None:
        config["eagle_config"] = {_VLLM_AUX_KEY: list(aux_from_engine(ids, layout))}
    return config, state


# ---- serving --------------------------------------------------------------------------------------
def serving_command(path, layout: str, target_path: str = "TARGET", *, tree: TreeConfig | None = None) -> str:
    """The shell command serving ``target_path`` with the head exported at ``path``.

    vLLM drafts a chain of ``tree.depth`` tokens (from the vllm or the speculators layout); SGLang drafts the
    EAGLE-2 tree (its draft-token count includes the root, hence ``total_tokens + 1``). tree: defaults to
    ``TreeConfig()``.
    """
    if layout == "speculators":
        return _speculators_command(path, target_path, tree or TreeConfig())
    layout = _check_layout(layout)
    if layout == "eagle":
        raise ValueError("no engine is served from the 'eagle' layout as is; export with layout='vllm' or 'sglang'")
    root = _check_dir(path)
    raw = _read_json(root / _CONFIG)
    found = detect_layout(raw)
    if found != layout:
        raise ValueError(f"{root} holds the {found!r} layout, not {layout!r}; export it with layout={layout!r} first")
    archs = " ".join(str(a) for a in raw.get("architectures") or []).lower()
    kind = "eagle3" if "eagle3" in archs or "draft_vocab_size" in raw else "eagle"
    tree = tree or TreeConfig()
    model = str(root.resolve())
    if layout == "vllm":
        spec = {"method": _METHOD["vllm"][kind], "model": model, "num_speculative_tokens": tree.depth}
        return f"vllm serve {shlex.quote(target_path)} --speculative-config {shlex.quote(json.dumps(spec))}"
    flags = [
        "python", "-m", "sglang.launch_server", "--model-path", target_path,
        "--speculative-algorithm", _METHOD["sglang"][kind], "--speculative-draft-model-path", model,
        "--speculative-num-steps", str(tree.depth), "--speculative-eagle-topk", str(tree.top_k),
        "--speculative-num-draft-tokens", str(tree.total_tokens + 1),
    ]
    return " ".join(shlex.quote(f) for f in flags)


def _speculators_command(path, target_path: str, tree: TreeConfig) -> str:
    root = _check_dir(path)
    kind = _read_json(root / _CONFIG).get("speculators_model_type")
    if kind not in _METHOD["vllm"]:
        raise ValueError(f"{root} is not a speculators EAGLE head (speculators_model_type={kind!r}); "
                         f"export it with layout='speculators' first")
    spec = {"method": _METHOD["vllm"][kind], "model": str(root.resolve()), "num_speculative_tokens": tree.depth}
    return f"vllm serve {shlex.quote(target_path)} --speculative-config {shlex.quote(json.dumps(spec))}"


# ---- files ----------------------------------------------------------------------------------------
def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return layout


def _check_dir(path) -> Path:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a directory; expected an exported head with {_CONFIG}")
    return root


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise FileNotFoundError(f"{file.parent} has no {file.name}; it is not a saved draft head")
    raw = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _read_engine_layout(path, target=None, *, dtype=None, device=None, strict: bool = True) -> DraftHead:
    """The registered reader: ``load_exported`` then the load options every layout takes. An engine layout is
    always read strictly (``strict`` is accepted for the common signature): an unknown tensor is an error."""
    head = load_exported(path, target)
    if dtype is not None:
        head.to(dtype=getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype)
    if device is not None:
        head.to(device)
    return head


def _claims(name: str):
    return lambda config: detect_layout(config) == name


for _name in ("vllm", "sglang"):
    register_layout(Layout(
        _name, write=lambda head, path, *, _name=_name, **kw: export_head(head, path, _name, **kw),
        read=_read_engine_layout, claims=_claims(_name),
    ))
