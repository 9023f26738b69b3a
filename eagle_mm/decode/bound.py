"""The head as a decode call uses it: bound to the call's target, and never the caller's object.

A call binds the head to its target (``DraftHead.attach``: the target's embedding table, EAGLE-1's lm_head) and
computes in the target's dtype. Done on the caller's head, both would change it for everyone: a head shared by a
model and its copy in another thread would be re-bound, or cast, under the other call (wrong drafts, dtype
errors), and an fp32 head used once with a bf16 target would come back cast. A call decodes with a copy instead: a
shallow one that shares the head's tensors when the dtypes agree (so training the head in place shows), else one
cast to the target's dtype, made again when the head's tensors change (a new tensor, or an in-place write: the
tensors' version counters). The decoder of (model, head) keeps it (``Decoder.bind``), with its ``stamp``.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..heads.base import DraftHead
from ..hf.dynamo import versions

__all__ = ["stamp", "head_copy"]


def stamp(head, dtype: torch.dtype):
    """What makes a kept copy of ``head`` for a target of ``dtype`` stale: the head's tensors replaced, its dtype
    changed, or (for a cast copy, which does not share them) its tensors written in place. None for an object that
    only behaves like a head (a wrapper around one): it is used as it is, its state its own."""
    if not isinstance(head, DraftHead):
        return None
    params = list(head.parameters())
    cast = dtype.is_floating_point and params[0].dtype != dtype
    return params[0].dtype, dtype, tuple(p.data_ptr() for p in params), versions(params) if cast else ()


def head_copy(head, dtype: torch.dtype, *, drop: tuple[str, ...] = ()):
    """The copy of ``head`` a call with a target of ``dtype`` decodes with (not yet attached): shallow when the dtypes
    agree, else cast; ``head`` itself when it only behaves like a head. ``drop``: instance attributes the copy must
    not share with the head."""
    if not isinstance(head, DraftHead):
        return head
    params = list(head.parameters())
    clone = _cast_copy(head, dtype) if dtype.is_floating_point and params[0].dtype != dtype else copy.copy(head)
    for name in drop:
        vars(clone).pop(name, None)
    return clone


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
