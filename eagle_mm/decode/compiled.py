"""The engine's compiled steps, kept on disk whole so that a second process traces nothing (``compile=``).

Inductor caches the code it generates, but a fresh process still runs dynamo over the step's Python (the HF forward,
layer by layer) to find the graph it then looks up: 4.7 s of the 8 s that a second process spent in code-tiny's first
compiled call on the H200, where the kernels themselves came from the disk. Each step is compiled here with dynamo's
ahead-of-time API (``torch.compile(fn, fullgraph=True).aot_compile``), which returns the traced function whole (its
bytecode, guards and inductor's code) to be saved, and a second process loads it instead of tracing.

The files live under ``<TORCHINDUCTOR_CACHE_DIR>/eagle_mm`` (so the variable that moves inductor's cache moves them
too). Torch cannot save guards on identities (which classes, functions and hooks were traced, ``ID_MATCH`` and the
like), so they are left out of the saved guards and put in the file's key instead: the versions of Python, torch and
transformers, a hash of this package's source, the classes, hooks and instance-replaced ``forward`` of the owner's
modules, its config, and the argument signature (tensor shapes, dtypes, devices and strides, plain values, and the
public plain attributes of the other objects). The guards that are saved (shapes, config values read while tracing,
global state) are still checked before each call; a step whose saved guards fail is compiled again.

A step that cannot be compiled this way (a graph break, a guard torch cannot save) is compiled by plain
``torch.compile``, in this process only, with a logged warning: the same kernels, only the trace is not kept.

Loading a file unpickles it, which runs code, so a file is trusted only as far as whoever could write it. It is
loaded only from a folder that this user (or root) owns and no one else can write, below folders of the same kind
(or sticky ones, such as /tmp), as ssh checks its keys' folders; only if the file itself is such a file and not a
link; and only if its header names the key it is looked up under and the checksum of its bytes. Otherwise the
step is compiled again, with one warning saying why (an unsafe folder: compiled in this process and not saved).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import stat
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch

from ..hf.dynamo import aot_compile, compiler_failure, inductor_cache_dir, is_static, load_compiled, \
    module_hooks, savable_guards, serialized
from ..hf.generation import attention_implementation
from .signature import Signature, alive

logger = logging.getLogger(__name__)

__all__ = ["DiskCompiled", "cache_folder"]

_PLAIN = (bool, int, float, str, type(None))
_MAX_ENTRIES = 8  # compilations kept per argument signature, like dynamo's own recompile limit
_SOURCE: str | None = None
_MAGIC = b"eagle_mm compiled step\n"  # then a JSON line (the key the file was saved under, its payload's sha256)


def cache_folder() -> Path:
    """Where compiled steps are kept: ``eagle_mm`` inside inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``)."""
    return inductor_cache_dir() / "eagle_mm"


def _source_hash() -> str:
    # This package's own functions are traced: a changed file is a new key, also in a checkout whose version stays.
    global _SOURCE
    if _SOURCE is None:
        h, root = hashlib.sha256(), Path(__file__).resolve().parents[1]
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
        _SOURCE = h.hexdigest()
    return _SOURCE


def _name(obj) -> str:
    """A stable name for a class, function, bound method or closure (what identity guards would have checked)."""
    if hasattr(obj, "__func__"):  # a bound method: its class and function
        return f"{_name(type(obj.__self__))}.{obj.__func__.__name__}"
    if hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
        return f"partial({_name(obj.func)})"
    if not hasattr(obj, "__qualname__"):
        obj = type(obj)
    return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"


def _signature(x, depth: int = 0):
    """What the saved guards cannot tell apart in an argument: a JSON-able description (see the module's doc)."""
    if isinstance(x, torch.Tensor):
        return ["T", list(x.shape), list(x.stride()), str(x.dtype), str(x.device), is_static(x)]
    if isinstance(x, _PLAIN):
        return x
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, enum.Enum):
        return ["E", _name(type(x)), x.name]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [_signature(v, depth) for v in x]]
    if isinstance(x, torch.nn.Module):
        return ["M", _name(type(x))]  # the owner's modules are in ``_owner_facts``
    if dataclasses.is_dataclass(x) and depth < 2:
        fields = {f.name: _signature(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)}
        return ["D", _name(type(x)), fields]
    plain = {k: _signature(v) for k, v in sorted(getattr(x, "__dict__", {}).items())
             if not k.startswith("_") and _is_plain(v)}  # private attributes hold ids and the like
    return ["O", _name(type(x)), plain]


def _is_plain(v) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(e, _PLAIN) for e in v))


def _owner_facts(owner: torch.nn.Module) -> list:
    """The classes, hooks and replaced ``forward`` of every module of the owner (and of the modules they hold
    outside their submodules), and its config: guards on identities are not saved."""
    mods = []
    for name, m in owner.named_modules():
        hooks = [_name(h) for h in module_hooks(m)]
        held = [[k, _name(type(h)), _replaced_forward(h)] for k, h in _held_modules(m)]
        mods.append([name, _name(type(m)), hooks, m.training, _replaced_forward(m), held])
    config = getattr(owner, "config", None)
    if hasattr(config, "to_json_string"):
        config = [config.to_json_string(use_diff=False), attention_implementation(config)]
    hooks = [_name(h) for h in module_hooks()]
    return [mods, repr(config), hooks]


def _replaced_forward(m: torch.nn.Module) -> str | None:
    # a forward set on the instance (a kernel hub's ``kernelize``, a wrapper) is what the trace calls
    forward = m.__dict__.get("forward")
    return None if forward is None else _name(forward)


def _held_modules(m: torch.nn.Module):
    """Modules kept in a plain attribute or a dict attribute rather than registered (transformers 5.25 keeps its
    per-layer kernel functions so): the trace runs them too."""
    for key, value in m.__dict__.items():
        if key == "_modules":
            continue
        for sub, x in (value.items() if isinstance(value, dict) else [("", value)]):
            if isinstance(x, torch.nn.Module):
                yield f"{key}{sub and '.' + str(sub)}", x


def _write(path: Path, data: bytes) -> None:
    # Atomic: another process may be reading the same key (torch 2.11's own writer is not). mkstemp: mode 0600.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _pack(key: str, payload: bytes) -> bytes:
    head = json.dumps({"key": key, "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return _MAGIC + head + b"\n" + payload


def _unpack(data: bytes, key: str) -> bytes:
    """The payload of a file ``_pack`` wrote for ``key``; a ValueError saying what is wrong with any other file,
    before a byte of it is unpickled."""
    if not data.startswith(_MAGIC):
        raise ValueError("not a compiled step this library wrote")
    head, _, payload = data[len(_MAGIC):].partition(b"\n")
    try:
        meta = json.loads(head)
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise ValueError("its header is damaged")
    if meta.get("key") != key:
        raise ValueError("it was saved for another step or call: its key differs from its name's")
    if meta.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise ValueError("its bytes do not match their checksum: damaged or truncated")
    return payload


def _read_private(path: Path) -> bytes:
    """The bytes of ``path``, not through a link, if it belongs to this user (or root) and no one else may write
    it (checked on the opened file, so a file swapped in after a check is not read); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        why = _not_private(os.fstat(f.fileno()), path)
        if why is not None:
            raise PermissionError(why)
        return f.read()


def _untrusted_folder(folder: Path) -> str | None:
    """Why compiled steps must not be loaded from (or saved to) ``folder``; None if they may. As ssh checks the
    folders of its keys: the folder and each one above it must belong to this user or root and be writable by no
    one else, except that a folder above it may be writable by all if it is sticky, as /tmp is (others cannot
    move or replace there what is not theirs). A folder not made yet is made private by this process."""
    if os.name != "posix":
        return None  # owners and modes are POSIX's; elsewhere the folder is the user's to choose
    folder = Path(os.path.realpath(folder))
    for p in (*reversed(folder.parents), folder):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return None
        except OSError as e:  # no permission to look: nothing below can be vouched for
            return f"{p} cannot be examined ({e.strerror})"
        why = _not_private(st, p, sticky_ok=p != folder)
        if why is not None:
            return why
    return None


def _not_private(st: os.stat_result, path: Path, sticky_ok: bool = False) -> str | None:
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to another user (uid {st.st_uid})"
    others = stat.S_IWOTH | (0 if _own_group(st.st_gid) else stat.S_IWGRP)
    if st.st_mode & others and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by other users ({stat.filemode(st.st_mode)})"
    return None


def _own_group(gid: int) -> bool:
    """Whether ``gid`` is this user's own group, of no other member (Debian's user private groups, whose umask
    002 makes every new folder group-writable)."""
    import grp
    import pwd

    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


class DiskCompiled:
    """``torch.compile(fn, dynamic=False, mode=mode)`` for a step ``fn(owner, *args)``, each compilation saved under
    ``cache_folder()`` and loaded from there by later processes (see the module's doc). A compilation that inductor
    fails runs ``fn`` itself from then on, with a warning. ``setup``: seconds spent loading and compiling;
    ``loaded`` and ``compiled`` count them (tests read them)."""

    def __init__(self, fn, what: str, mode: str):
        self.fn, self.what, self.mode = fn, what, mode
        self._entries: dict[str, list] = {}  # argument signature -> compiled functions, checked in order
        self._seen: OrderedDict = OrderedDict()  # Signature key -> (function whose guards passed, its weak refs)
        self._plain = None  # fn itself or torch.compile(fn), once this step is found not to compile ahead of time
        self._plain_ran = False
        self._refused = False  # whether the cache folder was last found unsafe (warned once)
        self.setup, self.loaded, self.compiled = 0.0, 0, 0

    def __call__(self, *args):
        if self._plain is not None:
            return self._run_plain(args)
        # The guards run once per new set of argument objects, not on every cycle: checking them in Python cost
        # 0.8 ms a call, 5% of code-tiny's compiled cycle on a CPU. (A captured graph on CUDA checks nothing.)
        sig = Signature(args, frozenset())
        seen = self._seen.get(sig.key)
        if seen is not None and alive(seen[1], sig.refs):
            return seen[0](*args)
        fn = self._find(args)
        if fn is None:
            return self._run_plain(args)
        self._seen[sig.key] = (fn, sig.refs)
        while len(self._seen) > 4 * _MAX_ENTRIES:
            self._seen.popitem(last=False)
        return fn(*args)

    def _find(self, args: tuple):
        """The compiled function whose guards pass for ``args``: kept, loaded or compiled (None: run ``_plain``)."""
        sig = json.dumps(_signature(args[1:]))
        for fn in self._entries.get(sig, ()):
            if fn.guard_check(*args):
                return fn
        t0 = time.perf_counter()
        try:
            key = self._key(sig, args)
            path = cache_folder() / f"{self.fn.__name__}-{key[:32]}.bin"
        except Exception as e:  # a config that does not print, a cache folder that cannot be made: no file for it
            self._in_process_only(f"no file for it: {_first_line(e)}")
            return None
        kept = self._trusted(path.parent)
        try:
            fn = (self._load(path, key, args) if kept else None) or self._compile(path if kept else None, key, args)
        except compiler_failure() as e:
            self._uncompiled(e)
        finally:
            self.setup += time.perf_counter() - t0
        if self._plain is not None:
            return None
        entries = self._entries.setdefault(sig, [])
        entries.insert(0, fn)
        del entries[_MAX_ENTRIES:]
        return fn

    def _run_plain(self, args: tuple):
        if self._plain_ran:
            return self._plain(*args)
        t0 = time.perf_counter()  # torch.compile's first call: its compile
        try:
            return self._plain(*args)
        except compiler_failure() as e:
            self._uncompiled(e)
            return self.fn(*args)
        finally:
            self._plain_ran = True
            self.setup += time.perf_counter() - t0

    def _uncompiled(self, e: Exception) -> None:
        logger.warning("compiling the %s failed (%s); it runs uncompiled", self.what, _first_line(e))
        self._plain, self._plain_ran = self.fn, True

    def _in_process_only(self, why: str) -> None:
        logger.warning("the %s cannot be compiled ahead of time (%s); it is compiled in this process only, and a new "
                       "process traces it again", self.what, why)
        self._plain = torch.compile(self.fn, dynamic=False, mode=self.mode)

    def _key(self, sig: str, args: tuple) -> str:
        key = json.dumps([sys.version, torch.__version__, _transformers_version(), _source_hash(), self.mode,
                          _name(self.fn), _owner_facts(args[0]), sig, torch.is_grad_enabled(),
                          torch.get_default_dtype().__repr__()])
        return hashlib.sha256(key.encode()).hexdigest()

    def _trusted(self, folder: Path) -> bool:
        """Whether compiled steps may be loaded from and saved to ``folder`` (see ``_untrusted_folder``); a warning
        the first time this step finds they may not."""
        why = _untrusted_folder(folder)
        if why is not None and not self._refused:
            logger.warning("the compiled %s is neither loaded from nor saved to %s: %s, and loading runs the code it "
                           "finds; it is compiled in this process. Point TORCHINDUCTOR_CACHE_DIR at a folder only you "
                           "can write (torch keeps its own compiled code there too)", self.what, folder, why)
        self._refused = why is not None
        return why is None

    def _load(self, path: Path, key: str, args: tuple):
        try:
            payload = _unpack(_read_private(path), key)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # another user's file, a link, another step's file, a damaged file
            logger.warning("the compiled %s in %s is not loaded (%s); compiling it again", self.what, path,
                           _first_line(e))
            return None
        try:
            fn = load_compiled(payload, self.fn.__globals__)  # guards checked by _find, once per new set of arguments
            fits = fn.guard_check(*args)
        except Exception as e:  # a file from another build of torch, guards written for other arguments...
            logger.warning("loading the compiled %s from %s failed (%s); compiling it again", self.what, path,
                           _first_line(e))
            return None
        if not fits:
            logger.info("the compiled %s in %s does not fit this call; compiling it again", self.what, path)
            return None
        self.loaded += 1
        logger.debug("loaded the compiled %s from %s", self.what, path)
        return fn

    def _compile(self, path: Path | None, key: str, args: tuple):
        """Compiled ahead of time and saved to ``path`` (None: not saved), or None with ``_plain`` set."""
        try:  # guards torch cannot save are left to the file's key (the module's doc)
            fn = aot_compile(self.fn, args, self.mode, savable_guards)
        except compiler_failure():
            raise  # inductor itself failed: _find runs the step uncompiled from now on
        except Exception as e:  # a graph break, a guard torch cannot save
            self._in_process_only(_first_line(e))
            return None
        self.compiled += 1
        if path is None:
            return fn
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write(path, _pack(key, serialized(fn)))
        except Exception as e:
            logger.warning("saving the compiled %s to %s failed (%s); a new process compiles it again", self.what,
                           path, _first_line(e))
        return fn


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
