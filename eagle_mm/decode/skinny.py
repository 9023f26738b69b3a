"""On a CPU, a linear layer over a few rows computed as ``W @ x^T``: what makes a verify of a few tokens cheap there.

A decode cycle runs the target and the head over a few rows at a time (the tree's nodes, the accepted path). On
this project's CPU (torch 2.13's MKL build, fp32), ``F.linear`` over 2-128 rows costs 1.3-4.5x the same product
taken as ``torch.mm(W, x.T)``: for a 4-row verify, Qwen2.5-0.5B's 151,936 x 896 output layer takes 223 ms against
50 (and 89 ms for 1 row, what ``generate`` pays per token), code-tiny's 8,192 x 256 one 4.1 ms against 0.6. With
the linears taken this way, a verify of a few tokens costs about what one token does, as on a GPU, and speculation
pays on a CPU too (code-tiny: 0.95-1.03x ``generate`` without, 1.21-1.37x with, in one run each).

``skinny_linears(model, head)`` gives the plain ``nn.Linear`` modules (the exact class: quantized or adapter
subclasses keep their own forward) of fp32 CPU modules this forward for the decode cycles (``loop.py``: not the
prefill, which keeps ``generate``'s own arithmetic), then takes it back. It is an instance attribute, as accelerate's hooks are, never a change to a class: other models are not
touched, and a module whose forward is already replaced on the instance (by such a hook) is left alone. Calls that
overlap on one module share one replacement (counted), so another thread decoding the same model concurrently sees
the same arithmetic. Rows outside 2-128, other dtypes and other devices run ``F.linear`` as before.
"""
from __future__ import annotations

import contextlib
import threading
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["skinny_linears", "MAX_ROWS"]

MAX_ROWS = 128  # measured: up to here W @ x^T wins for every shape tried (it is never slower at 1 row either)

_GUARD = threading.Lock()
_COUNTS: dict = {}  # module -> how many decodes use its replacement now


def _forward(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not (2 <= rows <= MAX_ROWS and x.dtype == m.weight.dtype == torch.float32 and x.device.type == "cpu"):
        return F.linear(x, m.weight, m.bias)
    # (rows, N), laid out as F.linear's: models view their projections (Llama 4's rotary needs a last stride of 1).
    out = torch.mm(m.weight, (x if x.dim() == 2 else x.reshape(rows, k)).t()).t().contiguous()
    if m.bias is not None:
        out = out + m.bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])


def _linears(modules) -> list:
    return [m for root in modules for m in root.modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


@contextlib.contextmanager
def skinny_linears(*modules):
    """Within the block, the plain fp32 CPU ``nn.Linear`` modules under ``modules`` take few-row inputs as
    ``W @ x^T`` (see the module docstring); afterwards they are as they were."""
    mine = []
    with _GUARD:
        for m in _linears(modules):
            if m in _COUNTS:
                _COUNTS[m] += 1
            elif "forward" not in m.__dict__:
                m.forward = partial(_forward, m)
                _COUNTS[m] = 1
            else:
                continue
            mine.append(m)
    try:
        yield
    finally:
        with _GUARD:
            for m in mine:
                _COUNTS[m] -= 1
                if not _COUNTS[m]:
                    del _COUNTS[m]
                    m.__dict__.pop("forward", None)
