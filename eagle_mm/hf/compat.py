"""Differences between the supported transformers releases (the range in setup.cfg), in one place."""
from __future__ import annotations

import functools
import inspect

__all__ = ["cache_kwarg", "output_cache"]


@functools.lru_cache(maxsize=None)
def _cache_kwarg_for(cls) -> str:
    params = inspect.signature(cls.forward).parameters
    # 5.24 renamed `past_key_values` to `cache` (the old name is still accepted with a warning).
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model) -> str:
    """The forward keyword that takes the KV cache for this model class."""
    return _cache_kwarg_for(type(model))


def output_cache(output):
    """The cache returned by a forward, whichever name the release uses."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)
