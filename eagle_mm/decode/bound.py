"""The head as a decode call uses it: bound to the call's target, and never the caller's object.

A call binds the head to its target (``DraftHead.attach``: the target's embedding table, EAGLE-1's lm_head) and
computes in the target's dtype. Done on the caller's head, both would change it for everyone: a head shared by a
model and its copy in another thread would be re-bound, or cast, under the other call (wrong drafts, dtype
errors), and an fp32 head used once with a bf16 target would come back cast. ``bound_head(model, head)`` returns a
copy kept per (model, head): a shallow one that shares the head's tensors when the dtypes agree (so training the
head in place shows), else one cast to the target's dtype, made again when the head's tensors change (a new
tensor, or an in-place write: the tensors' version counters). The engine keys its buffers and graphs on that
copy, so they are per (model, head), and the model's lock (``loop.py``) keeps two calls on one model from using
them at once.
"""
from __future__ import annotations

import copy
import threading
import weakref

import torch
from torch import nn

from ..heads.base import DraftHead

__all__ = ["bound_head", "forget"]

_GUARD = threading.Lock()
_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {head: (stamp, bound copy)}
_AS_IS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> WeakSet of heads used as they are


def bound_head(model, head, dtype: torch.dtype):
    """The copy of ``head`` a call on ``model`` (whose embeddings are ``dtype``) decodes with, attached to it.
    A head that is already such a copy for ``model`` (``tree="auto"`` decodes with it) is returned as it is; an
    object that only behaves like a head (a wrapper around one) is attached and used as it is, its state its own."""
    if not isinstance(head, DraftHead):
        with _GUARD:
            _AS_IS.setdefault(model, weakref.WeakSet()).add(head)
        head.attach(model)
        return head
    params = list(head.parameters())
    cast = dtype.is_floating_point and params[0].dtype != dtype
    # What makes a kept copy stale: the head's tensors replaced, its dtype changed, or (for a cast copy, which does
    # not share them) its tensors written in place.
    stamp = (params[0].dtype, dtype, tuple(p.data_ptr() for p in params),
             tuple(p._version for p in params) if cast else ())
    with _GUARD:
        table = _BOUND.setdefault(model, weakref.WeakKeyDictionary())
        if any(entry[1] is head for entry in table.values()):
            return head
        entry = table.get(head)
        if entry is None or entry[0] != stamp:
            entry = table[head] = (stamp, _cast_copy(head, dtype) if cast else copy.copy(head))
    return entry[1].attach(model)


def _cast_copy(head, dtype: torch.dtype):
    """A deep copy of ``head`` with its floating-point parameters in ``dtype`` (cast straight from the head's, so
    that no second full-precision copy is made), without its target (``attach`` binds the copy)."""
    memo = {id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False)
            for p in head.parameters() if p.is_floating_point()}
    target = getattr(head, "_target", None)
    if target is not None:
        memo[id(target)] = None
    clone = copy.deepcopy(head, memo)
    clone.to(dtype)  # the floating-point buffers, as Module.to casts them (a head keeps its rotary table fp32)
    return clone


def forget(model, head=None) -> list:
    """Drop the copies kept for ``model`` (of ``head`` only, if given); returns them and the heads used as they are
    (what the engine's state is keyed on)."""
    with _GUARD:
        table, as_is = _BOUND.get(model, {}), _AS_IS.get(model, weakref.WeakSet())
        if head is None:
            _BOUND.pop(model, None)
            _AS_IS.pop(model, None)
            return [bound for _, bound in table.values()] + list(as_is)
        entry = table.pop(head, None)
        as_is.discard(head)
        return ([] if entry is None else [entry[1]]) + ([head] if not isinstance(head, DraftHead) else [])
