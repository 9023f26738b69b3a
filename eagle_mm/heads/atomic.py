"""Directory writes that a crash cannot leave half done: build the new directory beside the old, then swap.

``with atomic_dir(path, replaces=names) as stage:`` hands the writer an empty directory beside ``path``. When
the block ends without an error, the old directory's other entries (those not written and not in
``replaces(old)``) are hard-linked into ``stage`` (copied where links fail), and ``stage`` is swapped in for
``path``: one ``renameat2(RENAME_EXCHANGE)`` on Linux, so every reader finds the old directory or the new one
at ``path``, never a mix. Where the kernel or file system lacks the exchange, two renames do it (old aside, new
in) and, between them, ``path`` briefly does not exist. An error inside the block removes ``stage`` and leaves
``path`` as it was.

``file_sha256`` is the checksum this library records for the files it writes (a head's weights in its
``config.json``, every file of a training checkpoint in its ``trainer_state.json``) and checks when it reads them:
safetensors and torch files carry none, so a flipped byte inside a tensor would otherwise load without a word.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

__all__ = ["atomic_dir", "file_sha256", "check_sha256"]

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_CHUNK = 8 << 20


def file_sha256(path) -> str:
    """The sha256 of a file's bytes, read once in 8 MiB chunks (hashlib runs without the GIL on them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(files: dict[str, Path], recorded, where: Path, fix: str) -> None:
    """ValueError naming the first of ``files`` (name -> path) that ``where`` does not record, that is missing, or
    whose bytes are not those whose sha256 it recorded when this library wrote them; ``fix``: what to do then."""
    if not isinstance(recorded, dict):
        raise ValueError(f"{where}: the sha256 record must map file names to digests, got {recorded!r}; {fix}")
    for name, path in files.items():
        want = recorded.get(name)
        if want is None:
            raise ValueError(f"{path} is not among the files {where} records ({sorted(recorded)}): it was not "
                             f"written with it; {fix}")
        if not path.is_file():
            raise ValueError(f"{path} is missing, though {where} records it; {fix}")
        got = file_sha256(path)
        if got != want:
            raise ValueError(f"{path} is damaged: its bytes changed after it was written (sha256 {got[:16]}..., "
                             f"{where} records {str(want)[:16]}...); {fix}")


@contextmanager
def atomic_dir(path, *, replaces: Callable[[Path], Iterable[str]] = lambda old: ()) -> Iterator[Path]:
    """Yield a staging directory; on success it becomes ``path`` in one swap (see the module docstring).

    replaces(old_dir): names in the old directory that the new one drops (files of an earlier save in another
    format). Everything else the writer did not write is carried over, so a head saved into a training output
    directory keeps its checkpoints and logs. Write new files only: carried files are hard links to the old ones.
    """
    root = _real_dir(Path(path).expanduser())
    root.parent.mkdir(parents=True, exist_ok=True)
    stage = _new_dir(root)
    try:
        yield stage
        if root.exists():
            _carry(root, stage, set(replaces(root)))
        _sync_tree(stage)
        _swap(stage, root)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _sync_dir(root.parent)


def _real_dir(root: Path) -> Path:
    """``root`` with symlinks resolved (the directory they name is replaced, not the link); refuses a file."""
    try:
        real = Path(os.path.realpath(root, strict=True)) if os.path.lexists(root) else root
    except FileNotFoundError:  # a dangling link: the directory it names is created
        real = Path(os.path.realpath(root))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{str(root)!r} is a symlink loop; point it at a directory or remove it") from e
        raise
    if real.exists() and not real.is_dir():
        raise ValueError(f"{str(root)!r} is a file; expected a directory (it is created if missing)")
    return real


def _new_dir(root: Path) -> Path:
    """An empty directory beside ``root`` with the mode ``root`` has (or the umask's, as ``mkdir`` gives)."""
    while True:
        stage = root.with_name(f".{root.name}.new-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(stage)  # not mkdtemp: its 0o700 would become the head directory's mode
            break
        except FileExistsError:
            continue
    if root.is_dir():
        os.chmod(stage, stat.S_IMODE(root.stat().st_mode))
    return stage


def _carry(old: Path, stage: Path, dropped: set[str]) -> None:
    for entry in os.scandir(old):
        if entry.name in dropped or (stage / entry.name).exists():
            continue
        src, dst = Path(entry.path), stage / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif entry.is_dir():
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        logger.warning("cannot hard-link %s (%s); copying it", src, e)
        shutil.copy2(src, dst)


def _swap(stage: Path, root: Path) -> None:
    """Put ``stage`` at ``root``; the old ``root`` is deleted."""
    if not root.exists():
        os.rename(stage, root)
        return
    if _exchange(stage, root):
        old = stage  # after the exchange, the staging name holds the old directory
    else:
        old = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.old-"))
        os.rename(root, old / root.name)
        try:
            os.rename(stage, root)
        except BaseException:
            os.rename(old / root.name, root)
            old.rmdir()
            raise
    try:
        shutil.rmtree(old)
    except OSError as e:  # the new head is in place; only the old copy is left over
        logger.warning("could not remove the replaced directory %s: %s", old, e)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where unsupported, so the caller renames twice."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except (OSError, TypeError):  # no C library to open by name (Windows)
        fn = None
    if fn is None:
        logger.warning("renameat2 is unavailable; replacing %s with two renames (not atomic)", b)
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        logger.warning("this file system cannot exchange directories; replacing %s with two renames (not atomic)", b)
        return False
    raise OSError(err, f"cannot swap {a} into {b}: {os.strerror(err)}")


def _sync_tree(stage: Path) -> None:
    """fsync the new files and the staging directory, so the swap never publishes data still in page cache."""
    for entry in os.scandir(stage):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _sync_dir(stage)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
