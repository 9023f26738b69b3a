"""The torch compiler's marks the engine relies on: which tensors keep their address between calls.

A tensor marked with ``mark_static`` is used in place by a compiled step (its address is part of what the step was
compiled for) and by a captured CUDA graph (``decode/graphs.py``); parameters count as static too.
"""
from __future__ import annotations

import torch

__all__ = ["mark_static", "is_static"]


def mark_static(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as staying at its address (dynamo's static address); returns it."""
    torch._dynamo.mark_static_address(t)
    return t


def is_static(t: torch.Tensor) -> bool:
    """Whether ``t`` is marked static, or is a parameter."""
    # The attribute first: isinstance against Parameter's metaclass costs ~10x more, on every graph replay.
    return getattr(t, "_dynamo_static_input_type", None) is not None or isinstance(t, torch.nn.Parameter)
