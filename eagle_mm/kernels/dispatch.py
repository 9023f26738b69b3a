"""`verify_greedy` / `verify_sampling`: pick the Triton kernel or the torch reference for tree verification.

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

from .reference import rejection_walk, verify_greedy_reference

__all__ = ["verify_greedy", "verify_sampling", "BACKENDS", "ENV_BACKEND"]

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


def _sampling_module():
    from . import triton_sampling as module
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


def _resolve(backend: str | None, device: torch.device, width: int = 1, load=_triton_module) -> str:
    """``width`` = max(N+1, max_depth+1) for the greedy walk, which holds that many lanes in one program
    (the sampling walk holds none: 1). ``load`` imports the kernel module that would run."""
    chosen = backend or os.environ.get(ENV_BACKEND) or "auto"
    if chosen not in BACKENDS:
        raise ValueError(f"verify backend {chosen!r} unknown; expected one of {BACKENDS}")
    if chosen == "torch" or (chosen == "auto" and device.type != "cuda"):
        return "torch"  # the interpreter is for tests that ask for it, never picked on its own
    if device.type != "cuda" and not _interpreting():  # chosen is "triton" here
        raise RuntimeError(f"Triton verify needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 "
                           "set before the kernel module (eagle_mm.kernels.triton_*) is first imported")
    if width > MAX_NODES:
        if chosen == "triton":
            raise ValueError(f"Triton verify holds at most {MAX_NODES} nodes per row, got max(N+1, D+1) = {width}")
        return "torch"
    try:
        load()
    except ImportError as err:
        if chosen == "triton":
            raise RuntimeError(f"Triton verify requested but the kernel module failed to import: {err}") from err
        log.warning("Triton unavailable (%s); verification uses the torch reference", err)
        return "torch"
    return "triton"


def verify_greedy(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                  depth: torch.Tensor, max_depth: int, *, with_path: bool = False,
                  backend: str | None = None):
    """Greedy verification of a draft tree against the target's logits at its nodes.

    logits (B, N+1, V) fp16/bf16/fp32, root first; tree_tokens, parent, depth (B, N+1) integer, as in
    `eagle_mm.decode.tree.Tree` (0 <= parent[i] <= N, parents before children, depth <= max_depth; not
    checked: checking would read the device). Returns int64 (B,) tensors (accept_len, best, bonus),
    plus path (B, max_depth+1) as `reference.path_indices` gives when ``with_path``. Equal, bit for
    bit, to torch: target = logits.argmax(-1), `greedy_accept`, bonus = target[best]. No host sync; the
    kernel keeps no state between calls.
    """
    _check(logits, tree_tokens, parent, depth, max_depth)
    if _resolve(backend, logits.device, max(logits.shape[1], max_depth + 1)) == "triton":
        accept, best, bonus, path, _ = _triton_module().verify_greedy_triton(
            logits, tree_tokens, parent, depth, max_depth, with_path=with_path)
    else:
        accept, best, bonus, path, _ = verify_greedy_reference(
            logits, tree_tokens.long(), parent.long(), depth.long(), max_depth, with_path=with_path)
    return (accept, best, bonus, path) if with_path else (accept, best, bonus)


def _check_sampling(scores, q, tokens, parent, u, e) -> None:
    if scores.dim() != 3:
        raise ValueError(f"scores must be (B, N+1, V), got shape {tuple(scores.shape)}")
    B, n, V = scores.shape
    if n < 1 or V < 1:
        raise ValueError(f"scores shape {tuple(scores.shape)} needs at least the root node and one token")
    want = {"scores": (scores, (B, n, V)), "q": (q, (B, n, V)), "tokens": (tokens, (B, n)),
            "parent": (parent, (B, n)), "u": (u, (B, n)), "e": (e, (B, V))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} must be {shape}, from scores (B, N+1, V) = {(B, n, V)}")
        if name in ("tokens", "parent"):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        elif t.dtype not in _LOGIT_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} not supported; expected one of {_LOGIT_DTYPES}")
        if t.device != scores.device:
            raise ValueError(f"{name} is on {t.device} but scores on {scores.device}")


def verify_sampling(scores: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor,
                    u: torch.Tensor, e: torch.Tensor, *, backend: str | None = None):
    """Recursive rejection sampling down a draft tree, given its noise (see `eagle_mm.decode.sampling`).

    scores (B, N+1, V): the target's processed logits after each node (p = softmax(scores), -inf =
    masked); q (B, N+1, V): the draft distribution each node's children were drawn from; tokens,
    parent (B, N+1) integer as in `eagle_mm.decode.tree.Tree`; u (B, N+1) uniforms; e (B, V) Exp(1) noise.
    Floating inputs fp16/bf16/fp32 (the kernel computes in fp32; fp32 inputs are not copied).
    Returns int64 (B,) (accept_len, best, bonus). The torch reference is
    ``rejection_walk(tokens, parent, softmax(scores.float(), -1), q, u, e)``; the Triton walk softmaxes
    only the rows it visits and matches it up to last-bit rounding (triton_sampling's docstring). No host
    sync; token and parent values are not checked (checking would read the device).
    """
    _check_sampling(scores, q, tokens, parent, u, e)
    if _resolve(backend, scores.device, load=_sampling_module) == "triton":
        return _sampling_module().rejection_walk_triton(tokens, parent, scores.float(), q.float(), u.float(),
                                                        e.float())
    return rejection_walk(tokens.long(), parent.long(), torch.softmax(scores.float(), -1), q, u, e)
