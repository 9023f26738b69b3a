"""`verify_greedy`: pick the Triton kernel or the torch reference for greedy tree verification.

Backend choice, first match wins: the ``backend`` argument, then the environment variable
EAGLE_MM_VERIFY_BACKEND, then "auto". "auto" runs Triton on CUDA tensors when Triton imports and
the torch reference otherwise. "triton" forces the kernel and raises (naming the reason) when it
cannot run; it never falls back quietly. "torch" forces the reference.
Triton also runs CPU tensors under its interpreter (TRITON_INTERPRET=1, set before the first
import of the kernel module); that is how the tests check the kernel without a GPU.
"""
from __future__ import annotations

import logging
import os

import torch

from .reference import verify_greedy_reference

__all__ = ["verify_greedy", "BACKENDS", "ENV_BACKEND"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
ENV_BACKEND = "EAGLE_MM_VERIFY_BACKEND"
_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_NODES = 1024  # the Triton walk keeps a row's nodes in one program's registers


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _triton_module():
    """Import the kernel module lazily: TRITON_INTERPRET is read when its kernels are decorated."""
    from . import triton_greedy as module
    return module


def _check(logits, tree_tokens, parent, depth, max_depth) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, N+1, V), got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"logits dtype {logits.dtype} not supported; expected one of {_LOGIT_DTYPES}")
    B, n, V = logits.shape
    if n < 1 or V < 1:
        raise ValueError(f"logits shape {tuple(logits.shape)} needs at least the root node and one token")
    for name, t in (("tree_tokens", tree_tokens), ("parent", parent), ("depth", depth)):
        if tuple(t.shape) != (B, n):
            raise ValueError(f"{name} shape {tuple(t.shape)} must be (B, N+1) = {(B, n)} like logits")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device} but logits on {logits.device}")
    if not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth={max_depth!r} must be a non-negative int")


def _resolve(backend: str | None, device: torch.device, width: int) -> str:
    """``width`` = max(N+1, max_depth+1): the walk holds that many lanes in one program."""
    chosen = backend or os.environ.get(ENV_BACKEND) or "auto"
    if chosen not in BACKENDS:
        raise ValueError(f"verify backend {chosen!r} unknown; expected one of {BACKENDS}")
    if chosen == "torch":
        return "torch"
    if device.type != "cuda" and not _interpreting():
        if chosen == "triton":
            raise RuntimeError(f"Triton verify needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 "
                               "set before eagle_mm.kernels.triton_greedy is first imported")
        return "torch"
    if chosen == "auto" and device.type != "cuda":
        return "torch"  # the interpreter is for tests that ask for it, never picked on its own
    if width > MAX_NODES:
        if chosen == "triton":
            raise ValueError(f"Triton verify holds at most {MAX_NODES} nodes per row, got max(N+1, D+1) = {width}")
        return "torch"
    try:
        _triton_module()
    except ImportError as err:
        if chosen == "triton":
            raise RuntimeError(f"Triton verify requested but the kernel module failed to import: {err}") from err
        log.warning("Triton unavailable (%s); greedy verification uses the torch reference", err)
        return "torch"
    return "triton"


def verify_greedy(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                  depth: torch.Tensor, max_depth: int, *, with_path: bool = False,
                  backend: str | None = None):
    """Greedy verification of a draft tree against the target's logits at its nodes.

    logits (B, N+1, V) fp16/bf16/fp32, root first; tree_tokens, parent, depth (B, N+1) integer, as in
    `eagle_mm.tree.Tree` (0 <= parent[i] <= N, parents before children, depth <= max_depth; not
    checked: checking would read the device). Returns int64 (B,) tensors (accept_len, best, bonus),
    plus path (B, max_depth+1) as `eagle_mm.tree.path_indices` gives when ``with_path``. Equal, bit for
    bit, to torch: target = logits.argmax(-1), `greedy_accept`, bonus = target[best]. No host sync.
    """
    _check(logits, tree_tokens, parent, depth, max_depth)
    if _resolve(backend, logits.device, max(logits.shape[1], max_depth + 1)) == "triton":
        accept, best, bonus, path, _ = _triton_module().verify_greedy_triton(
            logits, tree_tokens, parent, depth, max_depth, with_path=with_path)
    else:
        accept, best, bonus, path, _ = verify_greedy_reference(
            logits, tree_tokens.long(), parent.long(), depth.long(), max_depth, with_path=with_path)
    return (accept, best, bonus, path) if with_path else (accept, best, bonus)
