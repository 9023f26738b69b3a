"""The ``streamer=`` of a ``model.generate`` call that runs a ``custom_generate`` callable.

transformers hands a ``custom_generate`` callable only the keywords its signature adds to ``GenerationMixin._sample``'s
(``_extract_generation_mode_kwargs``); ``streamer`` is one of ``_sample``'s own, so it never arrives, although
``generate`` has already sent it the prompt. The one place it can be read is ``generate``'s frame, below the
callable on the stack: a private detail of transformers, kept here in the adapter, with a test that fails if a
release moves it.
"""
from __future__ import annotations

import functools
import inspect
import sys

__all__ = ["generate_streamer"]


@functools.lru_cache(maxsize=None)
def _generate_code():
    from transformers.generation.utils import GenerationMixin

    return inspect.unwrap(GenerationMixin.generate).__code__


def generate_streamer(model):
    """The streamer given to the innermost running ``GenerationMixin.generate`` of ``model``, or None (no streamer,
    or not called from ``generate``)."""
    code = _generate_code()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is model:
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None
