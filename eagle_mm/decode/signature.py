"""The signature of a call, for functions run per signature (``graphs.OwnGraph``'s captures, ``compiled.DiskCompiled``'s
compilations): tensors by shape (static ones by address too), plain values and frozen dataclasses by value, any other
object by identity, checked through a weak reference so that a new object at a dead one's address is not taken for it.
"""
from __future__ import annotations

import weakref

import torch

from ..hf.dynamo import is_static

__all__ = ["Signature", "alive", "by_value"]

_VALUES = (bool, int, float, str, torch.dtype, torch.device, type(None))


def by_value(x) -> bool:
    """Plain values and frozen dataclasses that compare by value; a frozen dataclass compared by identity
    (``eq=False``: the storage's state objects) is keyed by identity, as other objects are."""
    params = getattr(type(x), "__dataclass_params__", None)
    return isinstance(x, _VALUES) or (params is not None and params.frozen and params.eq)


class Signature:
    """The signature of one call: a hashable key, weak references to the objects it holds by identity, and the
    call's transient tensors (those copied into the graph's buffers), in traversal order."""

    def __init__(self, args: tuple, unkeyed: frozenset):
        self.refs: list = []
        self.transient: list[torch.Tensor] = []
        self.device: torch.device | None = None  # the first CUDA tensor's device, None if there is none
        self._first: dict[int, int] = {}  # id of a transient tensor -> its index, for aliases (dynamo guards on them)
        self.key = tuple(None if i in unkeyed else self._part(a) for i, a in enumerate(args))

    def _part(self, x):
        if isinstance(x, torch.Tensor):
            if self.device is None and x.is_cuda:
                self.device = x.device
            # Called on every replay (~100 tensors for the update): the cheapest key that tells tensors apart. A
            # static tensor's address names its device too (one address space for the host and every GPU).
            if is_static(x):
                return ("s", x.data_ptr(), x.shape, x.stride(), x.dtype)
            if id(x) in self._first:  # the same tensor again: one buffer, as the function saw one tensor
                return ("alias", self._first[id(x)])
            self._first[id(x)] = len(self.transient)
            self.transient.append(x)
            return ("t", x.shape, x.stride(), x.dtype, x.device)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(self._part(v) for v in x))
        if by_value(x):
            return x
        try:
            self.refs.append(weakref.ref(x))
        except TypeError:  # no weak references to it (a dict, say): held, so that its id stays its own
            self.refs.append(lambda x=x: x)
        return ("id", id(x))


def alive(kept: list, now: list) -> bool:
    """Whether the objects ``kept`` refers to are alive and the very ones ``now`` refers to (a live object's id is
    its own; a dead one's may be reused)."""
    return all(k() is not None and k() is n() for k, n in zip(kept, now))
