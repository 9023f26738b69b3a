"""Checks on a head directory before its weights are read, so that a malformed file fails at load, named.

From the files' headers only (safetensors headers, the zip index of a ``pytorch_model.bin``): every weight file
readable and complete; every tensor's dtype what the config implies (``load_head`` then checks the shapes);
``d2t`` integer, in range and the same draft vocabulary as ``t2d``. Symlink loops are reported as such, not as
missing files.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import Eagle3Config
from .eagle import EagleHead
from .eagle3 import Eagle3Head

__all__ = ["check_head_files"]

_ID_BUFFERS = ("d2t", "t2d")


def check_head_files(path, *, names: tuple, weight_files, config_of) -> None:
    """Raise ValueError naming the file and the fix for what would otherwise fail later or load silently wrong.

    ``names``: the layout's file names (config first); ``weight_files(root)``: its weight files, or None;
    ``config_of(root, tensor_names)``: its head config (``heads.io`` passes its own readers, so this module needs
    none of them). Leaves to the loader what it reports itself (no directory, no config.json, no weights, an
    unknown layout).
    """
    root = Path(path).expanduser()
    _refuse_loop(root)
    if not root.is_dir():
        return
    for name in names:
        _refuse_loop(root / name)
    if not (root / names[0]).is_file():
        return
    files = weight_files(root)
    if files is None:
        return
    tensors = {}
    for file in files:
        tensors.update(_read_header(file))
    try:
        config = config_of(root, set(tensors))
    except ValueError:
        return  # not a layout this reader knows: the loader says which
    _check_tensors(config, tensors, root)


def _refuse_loop(path: Path) -> None:
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symlink loop (too many levels of symbolic links); point it at the "
                             f"real file or directory") from e


def _read_header(file: Path) -> dict:
    """name -> tensor, where only dtype and shape are read unless the values are asked for (``d2t`` / ``t2d``)."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                return {k: _Lazy(file, k, f.get_slice(k)) for k in f.keys()}
        with open(file, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
        # mmap reads the zip index, not the tensors (a legacy, non-zip pickle has to be read whole).
        obj = torch.load(file, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as e:  # safetensors, zip and pickle readers raise their own types; all mean the same here
        raise ValueError(f"cannot read {file}: {e}. A truncated or corrupt file has to be saved or downloaded "
                         f"again") from e
    # Anything but a state dict of tensors is the loader's error to report, with its own message.
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)} if isinstance(obj, dict) else {}


class _Lazy:
    """A safetensors entry: dtype and shape from the header; the values read on demand."""

    _DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}

    def __init__(self, file: Path, key: str, view):
        self.file, self.key = file, key
        self.shape = torch.Size(view.get_shape())
        self.dtype = self._DTYPES.get(view.get_dtype(), view.get_dtype())

    def is_floating_point(self) -> bool:
        return isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point

    def values(self) -> torch.Tensor:
        with safe_open(str(self.file), framework="pt") as f:
            return f.get_tensor(self.key)


def _values(t) -> torch.Tensor:
    return t.values() if isinstance(t, _Lazy) else t


def _expected(config) -> dict[str, torch.Tensor]:
    """The head's own tensors for ``config``, shapes and dtypes only (on the meta device: nothing allocated)."""
    with torch.device("meta"):
        head = Eagle3Head(config) if isinstance(config, Eagle3Config) else EagleHead(config)
    return head.state_dict()


def _check_tensors(config, tensors: dict, root: Path) -> None:
    own = _expected(config)
    for key in sorted(set(tensors) & set(own)):
        got, want = tensors[key], own[key]
        if want.is_floating_point() and not got.is_floating_point():
            raise ValueError(f"{root}: tensor {key} has dtype {got.dtype}, expected a floating dtype")
        if key == "d2t" and (got.is_floating_point() or got.dtype == torch.bool):
            raise ValueError(f"{root}: d2t has dtype {got.dtype}; it holds integer offsets (draft id -> target id), "
                             f"save it as int64")
        if key == "t2d" and got.is_floating_point():
            raise ValueError(f"{root}: t2d has dtype {got.dtype}; it is a bool mask over the target vocabulary")
    # Shapes are the loader's check (it names every mismatch); the maps are compared only when theirs are right.
    if all(k in tensors and tuple(tensors[k].shape) == tuple(own[k].shape) for k in _ID_BUFFERS):
        _check_vocab_maps(_values(tensors["d2t"]), _values(tensors["t2d"]), config.vocab_size, root)


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, root: Path) -> None:
    """``d2t[i] + i`` is draft id i's target id; ``t2d`` marks exactly those target ids."""
    target_ids = d2t.long() + torch.arange(d2t.numel())
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= vocab):
        raise ValueError(f"{root}: d2t maps draft ids to target ids in [{int(target_ids.min())}, "
                         f"{int(target_ids.max())}], outside the target vocabulary [0, {vocab})")
    if target_ids.unique().numel() != target_ids.numel():
        raise ValueError(f"{root}: d2t maps several draft ids to one target id; each draft id needs its own")
    if t2d.dtype != torch.bool and not bool(((t2d == 0) | (t2d == 1)).all()):
        raise ValueError(f"{root}: t2d holds values other than 0/1; it is a mask over the target vocabulary")
    marked = t2d.bool().nonzero().flatten()
    if not torch.equal(marked, target_ids.sort().values):
        raise ValueError(f"{root}: d2t and t2d disagree: d2t maps to {target_ids.numel()} target ids, t2d marks "
                         f"{marked.numel()}, and they differ (e.g. d2t gives "
                         f"{target_ids[:4].tolist()}, t2d marks {marked[:4].tolist()}); save both from one vocabulary")
