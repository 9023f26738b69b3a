"""What the engine uses of torch's internals: the compiler's beyond its public API, and tensors' version counters.

Version counters: every in-place write to a tensor bumps its ``_version``; the decoder reads them to tell whether a
head's tensors changed since it copied them (``decode/bound.py``).

Static addresses: a tensor marked with ``mark_static`` is used in place by a compiled step (its address is part of what
the step was compiled for) and by a captured CUDA graph (``decode/graphs.py``); parameters count as static too.

Compiled steps kept on disk (``decode/compiled.py``): dynamo's ahead-of-time compile, saving and loading, inductor's
cache folder and mode options, the guard filter that leaves out what torch cannot save, and the hooks a trace ran.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import torch

__all__ = ["versions", "mark_static", "is_static", "compiler_failure", "inductor_cache_dir", "module_hooks",
           "savable_guards", "aot_compile", "serialized", "load_compiled"]


def versions(tensors) -> tuple[int, ...]:
    """The version counters of ``tensors`` (each in-place write bumps its tensor's)."""
    return tuple(t._version for t in tensors)


def mark_static(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as staying at its address (dynamo's static address); returns it."""
    torch._dynamo.mark_static_address(t)
    return t


def is_static(t: torch.Tensor) -> bool:
    """Whether ``t`` is marked static, or is a parameter."""
    # The attribute first: isinstance against Parameter's metaclass costs ~10x more, on every graph replay.
    return getattr(t, "_dynamo_static_input_type", None) is not None or isinstance(t, torch.nn.Parameter)


def compiler_failure() -> type:
    """The exception inductor raises when it fails to compile (a backend failure, not a graph break)."""
    return torch._dynamo.exc.BackendCompilerFailed


def inductor_cache_dir() -> Path:
    """Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``, or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def module_hooks(m: torch.nn.Module | None = None) -> list:
    """The forward pre-hooks and forward hooks of ``m``, or the global ones every module runs (``m`` None)."""
    if m is None:
        glob = torch.nn.modules.module
        return [*glob._global_forward_pre_hooks.values(), *glob._global_forward_hooks.values()]
    return [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]


def savable_guards(entries) -> list[bool]:
    """dynamo's guard filter: keep every guard torch can save (the others belong in the saved file's key). Left out
    too: guards on a function's default values (torch 2.11 saves them but cannot load them back: its
    ``DefaultsSource`` does not unpickle), and guards on or through an object whose class is defined inside a function
    or a class: torch cannot save a type check on it, and saves the object itself as a bare ``nn.Module``, so guards
    through it fail to build at load (transformers 5.25's kernel-replaceable functions, ``apply_rotary_pos_emb``,
    are such objects)."""
    unsaved = torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    local = [re.compile(re.escape(n) + r"(?!\w)")
             for n in {e.name for e in entries if e.has_value and _local_class(e.value)}]
    return [not (e.guard_type in unsaved or any(d in unsaved for d in e.derived_guard_types)
                 or _through_defaults(e.orig_guard.originating_source) or any(p.search(e.name) for p in local))
            for e in entries]


def _local_class(value) -> bool:
    # torch's own test for a class it cannot name when saving (a nested class included)
    return type(value).__qualname__ != type(value).__name__


def _through_defaults(source) -> bool:
    while source is not None:
        if type(source).__name__ == "DefaultsSource":
            return True
        source = getattr(source, "base", None)
    return False


def aot_compile(fn, args: tuple, mode: str, guard_filter):
    """``fn`` compiled ahead of time for ``args`` (whole: ``fullgraph``, static shapes) with inductor in ``mode``,
    its guards filtered by ``guard_filter``; the guards are not checked on calls (the caller checks them with
    ``guard_check``). Raises ``compiler_failure()`` when inductor fails, another exception for a graph break or a
    guard that cannot be saved."""
    options = {**torch._inductor.list_mode_options(mode), "guard_filter_fn": guard_filter}
    with torch._dynamo.config.patch(enable_aot_compile=True):  # torch 2.11 offers it only when asked (2.13: always)
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, options=options).aot_compile((args, {}))
    compiled.disable_guard_check()
    return compiled


def serialized(compiled) -> bytes:
    """The bytes ``load_compiled`` reads back, in another process."""
    return type(compiled).serialize(compiled).serialized_data


def load_compiled(payload: bytes, f_globals: dict):
    """A compiled function from ``serialized``'s bytes (its guards not checked on calls, as ``aot_compile``'s)."""
    compiled = torch.compiler.load_compiled_function(io.BytesIO(payload), f_globals=f_globals)
    compiled.disable_guard_check()
    return compiled
