"""The chooser's measured step costs on disk, so that a later process measures nothing.

One JSON file per (machine, target, head, dtype, versions), in ``eagle_mm_costs`` beside the compiled steps'
folder (``compiled.cache_folder()``: inside inductor's cache folder, so ``TORCHINDUCTOR_CACHE_DIR`` moves both). The
file holds ``{"version", "key", "entries"}``: entries by batch and decoding kind (``entry_name``), each a
``costs.CycleCosts``. It is read as data: parsed as JSON and checked field by field, never unpickled; a file of
another version or key, or one that fails a check, is ignored (with one logged line) and replaced once measured
again. Writes are atomic (a temporary file renamed over the old one): a reader finds the old file or the new one.
A folder another user owns, or one others may write to, is neither read nor written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import stat
import tempfile
from pathlib import Path

import torch

from .compiled import cache_folder
from .costs import CycleCosts

logger = logging.getLogger(__name__)

__all__ = ["VERSION", "CostFile", "cost_folder", "cost_key", "decode_kind", "entry_name"]

# Bump when what a file holds, or how a cost is measured, changes (2: a one-row verify runs without skinny.py's mode;
# 3: the verify timed with and without the few-row linears, and where they won; 4: the greedy verify timed with its
# acceptance captured after it, as the sampled one was).
VERSION = 4


def cost_folder() -> Path:
    return cache_folder().parent / "eagle_mm_costs"


def machine(device: torch.device) -> str:
    """The hardware the costs were measured on: the GPU's name and size, or the CPU's model and thread count."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} (sm {p.major}.{p.minor}, {p.multi_processor_count} SMs)"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


def _fingerprint(module) -> str:
    config = getattr(module, "config", None)
    if hasattr(config, "to_json_string"):
        config = config.to_json_string(use_diff=False)
    elif hasattr(config, "to_dict"):
        config = json.dumps(config.to_dict(), sort_keys=True)
    dtype = next(module.parameters()).dtype
    text = f"{type(module).__module__}.{type(module).__qualname__}|{dtype}|{config}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cost_key(model, head, device: torch.device) -> dict:
    """What the costs depend on: the machine, the versions whose kernels run, the target's and head's shapes."""
    import transformers

    return {"machine": machine(device), "device": device.type, "torch": torch.__version__,
            "transformers": transformers.__version__, "target": _fingerprint(model), "head": _fingerprint(head)}


def decode_kind(sampler, graphs: bool, device: torch.device) -> str:
    """Costs differ by decoding kind: a sampled draft and acceptance by the proposal's width, and on a GPU by whether
    the steps replay as CUDA graphs (``graphs``) or run eagerly (a target split over devices, ``compile=False``)."""
    kind = "greedy" if sampler is None else f"sampled-{sampler.width}"
    return f"{kind}-eager" if device.type == "cuda" and not graphs else kind


def entry_name(batch: int, kind: str) -> str:
    """The name of the costs at ``batch`` rows of a ``decode_kind``."""
    return f"{batch}/{kind}"


class CostFile:
    """The file of one ``cost_key``: ``load`` its entries (empty when missing or rejected), ``save`` new ones."""

    def __init__(self, key: dict, folder: Path | None = None):
        self.key = key
        self.folder = Path(folder) if folder is not None else cost_folder()
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        self.path = self.folder / f"costs-{digest}.json"

    def _usable(self) -> bool:
        """The folder is ours alone (or does not exist yet)."""
        try:
            st = self.folder.stat()
        except FileNotFoundError:
            return True
        if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            logger.warning("not using the cost folder %s: another user owns it or others may write to it",
                           self.folder)
            return False
        return True

    def load(self) -> dict[str, CycleCosts]:
        try:
            return self._read()
        except (OSError, ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            logger.warning("ignoring the cost file %s (%s); the costs are measured again", self.path, e)
            return {}

    def _read(self) -> dict[str, CycleCosts]:
        if not self._usable() or not self.path.is_file():
            return {}
        data = json.loads(self.path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}, "
                             f"expected {VERSION}")
        if data.get("key") != self.key:
            raise ValueError("its key is another machine's or model's")
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("no entries")
        return {str(name): CycleCosts.from_json(e) for name, e in entries.items()}

    def save(self, entries: dict[str, CycleCosts]) -> None:
        """Write ``entries`` over the file's own (another process may have added some since this one read it)."""
        if not self._usable():
            return
        try:
            merged = {**self._read(), **entries}
        except (OSError, ValueError, UnicodeDecodeError):  # a damaged file: replaced (``load`` said so)
            merged = dict(entries)
        text = json.dumps({"version": VERSION, "key": self.key,
                           "entries": {n: c.as_json() for n, c in sorted(merged.items())}}, indent=1)
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=self.path.name + ".")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("could not save the measured costs to %s (%s); a new process measures them again",
                           self.path, e)
