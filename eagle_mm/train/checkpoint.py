"""Resumable checkpoints: ``output_dir/checkpoints/step-NNNNNNNN/``, each complete or absent.

A checkpoint is written by ``accelerator.save_state`` into a hidden temp directory beside its final place,
completed with ``train_config.json``, the head in its ``from_pretrained`` layout (``head/``) and
``trainer_state.json`` (written last), then renamed into place. Readers list only ``step-*`` directories that
hold ``trainer_state.json``, so a crash mid-write leaves the previous checkpoints as they were. A checkpoint whose
files cannot be read (truncated by a full disk, say) is named at resume: ``resume="auto"`` falls back to the latest
readable one, an explicit ``resume`` path stops with the file's name, both before anything is written.
``trainer_state.json`` also records the sha256 of every other file of the checkpoint, checked at resume in the same
way, so that bytes changed after the write (a failing disk, a partial copy) are named rather than resumed from;
checkpoints written before this record resume as before.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable

from safetensors import safe_open

from ..heads.atomic import check_sha256, file_sha256
from .config import TrainConfig

__all__ = ["CHECKPOINTS", "STATE_NAME", "CONFIG_NAME", "list_checkpoints", "resolve_resume", "check_resumable",
           "check_readable", "save_checkpoint", "write_state"]

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_NAME = "trainer_state.json"
CONFIG_NAME = "train_config.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``output_dir``, oldest first, as (step, directory)."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / STATE_NAME).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def resolve_resume(config: TrainConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; never writes anything.

    A fresh run into an output directory that already holds checkpoints is refused, so that they are not
    overwritten by accident.
    """
    existing = list_checkpoints(config.output_dir)
    if config.resume is None:
        if existing:
            raise ValueError(
                f"output_dir {config.output_dir} already holds checkpoints (latest: {existing[-1][1].name}); "
                f"pass resume='auto' (--resume) to continue that run, or choose another output_dir")
        return None
    if config.resume == "auto":
        return _latest_readable(existing) if existing else None
    path = Path(config.resume)
    if not (path / STATE_NAME).is_file():
        raise ValueError(f"resume directory {str(path)!r} is not a complete checkpoint: it has no {STATE_NAME}")
    check_readable(path)
    return path


def _latest_readable(existing: list[tuple[int, Path]]) -> Path:
    problems = []
    for _, path in reversed(existing):
        try:
            check_readable(path)
        except ValueError as e:
            logger.warning("%s; trying the checkpoint before it", e)
            problems.append(str(e))
            continue
        return path
    raise ValueError("no checkpoint can be resumed: " + "; ".join(problems) + ". Delete them to start again")


def check_readable(path: Path) -> None:
    """ValueError naming the first file of checkpoint ``path`` that is truncated or corrupt (read from the files'
    indexes: safetensors headers, the zip directories of torch files, JSON), then the first whose bytes differ
    from the sha256 its ``trainer_state.json`` recorded (one read of every file)."""
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        try:
            _probe(file)
        except Exception as e:  # each format's reader raises its own types; all mean "cannot be read"
            raise ValueError(f"checkpoint {path} cannot be resumed: {file} is unreadable ({type(e).__name__}: "
                             f"{e})") from e
    recorded = json.loads((Path(path) / STATE_NAME).read_text(encoding="utf-8")).get("sha256")
    if recorded is not None:  # written before checkpoints recorded their checksums: nothing to compare
        try:
            check_sha256({name: Path(path) / name for name in recorded}, recorded, Path(path) / STATE_NAME,
                         "resume from an earlier checkpoint")
        except ValueError as e:
            raise ValueError(f"checkpoint {path} cannot be resumed: {e}") from e


def _probe(file: Path) -> None:
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt"):
            return
    if file.suffix == ".json":
        json.loads(file.read_text(encoding="utf-8"))
        return
    if file.suffix in (".bin", ".pt", ".pth", ".pkl"):
        with open(file, "rb") as f:
            head = f.read(4)
        if head[:1] == b"\x80":  # a legacy (non-zip) torch pickle has no index to check
            return
        with zipfile.ZipFile(file):  # torch.save's format: a truncated file has lost its central directory
            return


def check_resumable(path: Path, config: TrainConfig, num_processes: int) -> dict:
    """The saved trainer state, after checking that ``config`` trains exactly what the checkpoint trained."""
    saved_file = path / CONFIG_NAME
    if not saved_file.is_file():
        raise ValueError(f"checkpoint {path} has no {CONFIG_NAME}; cannot tell whether it belongs to this run")
    saved = TrainConfig.load(saved_file)
    diff = saved.training_difference(config)
    if diff is not None:
        name, old, new = diff
        raise ValueError(f"cannot resume from {path}: training field {name!r} differs (checkpoint: {old!r}, "
                         f"now: {new!r}); resume with the same settings or start a new output_dir")
    state = json.loads((path / STATE_NAME).read_text(encoding="utf-8"))
    if state.get("num_processes") != num_processes:
        raise ValueError(f"cannot resume from {path}: it was written by num_processes={state.get('num_processes')} "
                         f"and this run has num_processes={num_processes}; the data order would differ")
    return state


def write_state(path: Path, state: dict) -> None:
    tmp = path / f".{STATE_NAME}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path / STATE_NAME)


def save_checkpoint(accelerator, output_dir, step: int, config: TrainConfig, write_extra: Callable[[Path], None],
                    keep: int) -> Path:
    """Write checkpoint ``step`` atomically; every process must call this. Returns its final directory."""
    root = Path(output_dir) / CHECKPOINTS
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))  # model, optimizer, registered objects, every process's RNG states
        write_extra(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            config.save(tmp / CONFIG_NAME)
            write_state(tmp, {"step": step, "num_processes": accelerator.num_processes, "format": 1,
                              "sha256": _checksums(tmp)})
            _replace_dir(tmp, final)
    except BaseException:
        if accelerator.is_main_process:  # the half-written checkpoint is not one; its space comes back (a full disk)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        _prune(root, keep)
        logger.info("checkpoint %s written", final)
    accelerator.wait_for_everyone()
    return final


def _checksums(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the trainer state (which holds this record) -> its sha256."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != STATE_NAME)
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in files}


def _replace_dir(src: Path, dest: Path) -> None:
    """Rename ``src`` to ``dest``; an existing ``dest`` is moved aside first and deleted after."""
    if not dest.exists():
        os.replace(src, dest)
        return
    old = dest.with_name(f".old-{dest.name}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(dest, old)
    os.replace(src, dest)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    done = list_checkpoints(root.parent)
    for _, d in done[:-keep]:
        logger.info("removing old checkpoint %s", d)
        shutil.rmtree(d, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        if stale.is_dir():  # an earlier crash's half-written checkpoint
            shutil.rmtree(stale, ignore_errors=True)
