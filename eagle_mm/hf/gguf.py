"""GGUF targets: a llama.cpp checkpoint (one ``.gguf`` file) used like a Hugging Face model folder.

transformers reads GGUF itself (``from_pretrained(folder, gguf_file=name)``, model and tokenizer, with the
``gguf`` package). That read is slow: parsing the file's metadata in Python and dequantizing take 15-30 s for a
135M model on two CPU cores. So the first use converts the file once into an ordinary model folder (the
dequantized weights as float32 safetensors, the tokenizer with its chat template, the generation config) in a
user cache, keyed by the file's SHA-256 and the transformers and gguf versions, written atomically; later uses
read that folder (under a second). Every loader in eagle_mm turns a target path into a folder through
``model_source``, so a ``.gguf`` path works wherever a model folder does.

The cache lives in ``$EAGLE_MM_CACHE/gguf/`` (default ``$XDG_CACHE_HOME/eagle_mm``, else ``~/.cache/eagle_mm``).
A converted folder holds the dequantized weights in float32 (about 4 bytes per parameter: 540 MB for 135M).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["GGUF_INSTALL", "CACHE_ENV", "is_gguf", "gguf_problem", "cache_root", "converted_dir", "model_source",
           "load_gguf"]

logger = logging.getLogger(__name__)

GGUF_INSTALL = "pip install gguf"
CACHE_ENV = "EAGLE_MM_CACHE"
# Bumped when what a converted folder holds changes, so that older conversions are not reused.
_FORMAT = 1
_DONE = "eagle_mm_gguf.json"  # written last into a converted folder: its presence means the folder is whole


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; it need not exist)."""
    return str(path).lower().endswith(".gguf")


def _gguf_version() -> str | None:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return None


def gguf_problem(path, flag: str = "--target") -> str | None:
    """The problem with ``path`` as a GGUF target, or None: the file is missing, or the gguf package is."""
    path = Path(path)
    if not path.is_file():
        return f"no such GGUF file: {path}; pass {flag} an existing .gguf file or a model directory"
    if _gguf_version() is None:
        return f"reading the GGUF file {path} needs the gguf package, which is not installed: {GGUF_INSTALL}"
    return None


def _require(path: Path) -> None:
    problem = gguf_problem(path)
    if problem is None:
        return
    if path.is_file():
        raise ImportError(problem)
    raise FileNotFoundError(problem)


def cache_root() -> Path:
    """Where converted GGUF folders are kept: ``$EAGLE_MM_CACHE/gguf``, else the user cache folder's."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle_mm"
    return Path(root).expanduser() / "gguf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _key(path: Path, sha: str) -> str:
    import transformers

    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:60]
    return f"{stem}-{sha[:16]}-tf{transformers.__version__}-gguf{_gguf_version()}-f{_FORMAT}"


def converted_dir(path, *, cache=None) -> Path:
    """The model folder converted from the GGUF file ``path``: from the cache, or converted now (once).

    ``cache``: the cache folder (default ``cache_root()``). Raises ImportError with the install command when the
    gguf package is missing, FileNotFoundError when the file is, and OSError naming ``$EAGLE_MM_CACHE`` when the
    cache cannot be written.
    """
    path = Path(path).expanduser().resolve()
    _require(path)
    root = Path(cache) if cache is not None else cache_root()
    sha = _sha256(path)
    folder = root / _key(path, sha)
    if (folder / _DONE).is_file():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    except OSError as e:
        raise OSError(f"cannot write the converted copy of {path} under {root} ({e}); set {CACHE_ENV} to a "
                      f"writable folder") from e
    try:
        logger.info("converting %s to a model folder in %s (once; later loads read it)", path, folder)
        _convert(path, stage, sha)
        _publish(stage, folder)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return folder


def _convert(path: Path, out: Path, sha: str) -> None:
    """transformers' own GGUF reading, saved as an ordinary folder (no quantization config left in it)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers raises several kinds for a GGUF file it cannot read
        raise ValueError(f"transformers cannot read a tokenizer from the GGUF file {path}: {e}") from e
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # idem: unsupported architecture, tensor type or damaged file
        raise ValueError(f"transformers cannot load the GGUF file {path} as a causal LM: {e}") from e
    # The weights are dequantized floats now, but the model still carries the GGUF quantizer, which refuses to
    # save: move them into a plain model of the same config (built on the meta device, so nothing is initialised).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)  # tied weights stay one tensor
    plain.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    _align_special_tokens(tokenizer, config)
    tokenizer.save_pretrained(out)
    import transformers

    done = {"source": str(path), "sha256": sha, "transformers": transformers.__version__, "gguf": _gguf_version(),
            "format": _FORMAT}
    (out / _DONE).write_text(json.dumps(done, indent=2) + "\n", encoding="utf-8")


def _align_special_tokens(tokenizer, config) -> None:
    """The tokenizer's bos/eos/pad tokens as the model config read them from the file's token ids.

    Some transformers releases (5.17) name other tokens for a byte-level GGUF vocabulary (eos as the file's
    bos, no pad), while the config, which ``generate`` stops on, has the file's ids.
    """
    for name in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            token = tokenizer.convert_ids_to_tokens(token_id)
            if getattr(tokenizer, f"{name}_token") != token:
                logger.info("GGUF tokenizer: %s_token %r -> %r (the file's %s id %d)", name,
                            getattr(tokenizer, f"{name}_token"), token, name, token_id)
                setattr(tokenizer, f"{name}_token", token)


def _publish(stage: Path, folder: Path) -> None:
    """Move the finished ``stage`` to ``folder`` in one rename; another process that got there first wins."""
    try:
        os.rename(stage, folder)
    except OSError:
        if not (folder / _DONE).is_file():  # not a race lost to another process: a real failure
            raise


def model_source(path) -> str:
    """What ``from_pretrained`` should read for the target ``path``: a GGUF file's converted folder, else ``path``."""
    return str(converted_dir(path)) if is_gguf(path) else str(path)


def load_gguf(path, *, dtype=None, device=None, attn_implementation: str = "sdpa"):
    """(model, tokenizer) from a GGUF file, through its converted folder; the model in eval mode.

    dtype: a torch dtype (default float32, the dequantized weights as they are); device: where the model goes.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_dir(path)
    # sdpa: the tree mask is an additive float mask that flash-attention kernels cannot take.
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32,
                                                 attn_implementation=attn_implementation, local_files_only=True)
    if device is not None:
        model = model.to(device)
    return model.eval(), AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
