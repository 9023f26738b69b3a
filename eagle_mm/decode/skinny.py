"""On a CPU, a linear layer over a few rows computed as ``W @ x^T``: what makes a verify of a few tokens cheap there.

A decode cycle runs the target and the head over a few rows at a time (the tree's nodes, the accepted path). On
this project's CPU (torch 2.13's MKL build, fp32), ``F.linear`` over 2-128 rows costs 1.3-4.5x the same product
taken as ``torch.mm(W, x.T)``: for a 4-row verify, Qwen2.5-0.5B's 151,936 x 896 output layer takes 223 ms against
50 (and 89 ms for 1 row, what ``generate`` pays per token), code-tiny's 8,192 x 256 one 4.1 ms against 0.6. With
the linears taken this way, a verify of a few tokens costs about what one token does, as on a GPU, and speculation
pays on a CPU too.

``skinny_linears()`` is a ``torch.overrides.TorchFunctionMode``: within its block, in the thread that entered it
(torch keeps the mode stack per thread), every few-row fp32 CPU ``F.linear`` call is taken as ``W @ x^T``. Nothing
is set on any module: another thread running the same model meanwhile computes exactly what it computes
otherwise. Rows outside 2-128, other dtypes and other devices run ``F.linear`` as before.

The price: every torch call in the block goes through Python (a few microseconds each; a one-row forward of
code-tiny, 635 calls, took 1.2-1.4x as long). A forward of a real model pays it many times over (a 4-row forward
of a Qwen2.5-0.5B-shaped model: 1.38x faster in the block), one of code-tiny about breaks even, so ``loop.py``
enters it around the cycle's verify and update only (not the draft, mostly one row per level on a CPU, nor the
prefill, which keeps ``generate``'s own arithmetic), and only where the chooser's probe timed the verify faster with
it on this machine (``CycleCosts.skinny``; a given tree follows what a default call measured, else runs without
it): in December 2026 this project's CPU ran code-tiny's one-token decoding at batch 4 1.6-1.8x slower with it.
Replacing each linear's ``forward`` on the instance paid slightly more (1.47x) but changed the user's modules for
every thread while a call ran.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["skinny_linears", "for_rows", "MAX_ROWS"]

MAX_ROWS = 128  # measured: up to here W @ x^T wins for every shape tried (it is never slower at 1 row either)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` as ``W @ x^T`` when x has few fp32 CPU rows, else None."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not (2 <= rows <= MAX_ROWS and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.dim() == 2 and (bias is None or bias.dtype == torch.float32)):
        return None
    # (rows, N), laid out as F.linear's: models view their projections (Llama 4's rotary needs a last stride of 1).
    out = torch.mm(weight, (x if x.dim() == 2 else x.reshape(rows, k)).t()).t().contiguous()
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])


class skinny_linears(TorchFunctionMode):  # noqa: N801 (used as a context manager, like a function)
    """``with skinny_linears(): ...``: few-row fp32 CPU ``F.linear`` calls in this thread as ``W @ x^T`` (see the
    module docstring); other threads, and this one after the block, are untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            out = _linear(*args, **(kwargs or {}))
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))


def for_rows(mode, rows: int):
    """``mode`` (a ``skinny_linears``, or a null context) for a forward of ``rows`` rows: one row has no few-row
    product to speed up, so it runs outside the mode, whose per-call cost would be all it adds (a sixth of a
    one-row cycle of code-tiny)."""
    return mode if rows > 1 else contextlib.nullcontext()
