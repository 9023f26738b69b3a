"""Finished rows stop costing: the storage moves its live rows to the front and goes on with fewer rows.

A batch keeps its shape while its rows decode; once rows have stopped (eos, a stopping criterion), each cycle
would still draft and verify them. Before a cycle, ``plan`` picks the rows to keep; the storage moves them to
its first rows (``FixedStorage.compact``, ``DynamicStorage.compact``) and the host's ``DecodeState.slots`` maps
storage rows to the call's rows from then on.

The engine keeps one target cache and one set of buffers at full batch size: a smaller batch runs on views of
their first rows (same addresses, so no new memory), and CUDA graphs are captured once per batch size, then
replayed by later calls. To bound those captures, CUDA-graph runs shrink to powers of two (a batch of 16 runs at
8, 4, 2, 1 rows as rows finish); eager runs shrink to the live rows exactly. Compiled runs keep their batch: each
new size would be a new inductor compile.

``cache_view(slots=n)`` is the same kind of view along the slots: the eager engine (the CPU) runs each forward over the
cache slots in use, where a captured graph needs the whole preallocated length. ``grown_cache`` is the other way:
the same stored slots in a longer cache, as the engine's grows.
"""
from __future__ import annotations

import copy

import torch

__all__ = ["plan", "move_rows", "static_rows", "cache_view", "grown", "grown_cache"]


def plan(slots: list[int], finished: list[bool], powers_of_two: bool) -> list[int] | None:
    """Storage rows to keep, in their new order (live rows first), or None to keep the batch as it is.

    slots[i]: the call's row held in storage row i; finished: per call row."""
    live = [i for i, b in enumerate(slots) if not finished[b]]
    if not live:
        return None
    size = 1 << (len(live) - 1).bit_length() if powers_of_two else len(live)
    if size >= len(slots):
        return None
    dead = [i for i, b in enumerate(slots) if finished[b]]
    return live + dead[: size - len(live)]  # a power-of-two batch keeps some finished rows as padding


def move_rows(tensors, keep: list[int], rows_now: int) -> None:
    """In place: storage rows ``keep`` of each tensor's first ``rows_now`` rows become its first len(keep) rows."""
    idx = None
    for t in tensors:
        if idx is None or idx.device != t.device:
            idx = torch.tensor(keep, device=t.device)
        t[: len(keep)].copy_(t[:rows_now].index_select(0, idx))  # index_select copies: sources may overlap


def static_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of a static buffer, as a view at the buffer's address, marked static like it (a captured
    graph uses it in place)."""
    view = t[:n]
    torch._dynamo.mark_static_address(view)
    return view


def cache_view(cache, rows: int | None = None, slots: int | None = None):
    """An HF ``Cache`` whose ``StaticLayer``s are views of ``cache``'s initialized layers: their first ``rows`` rows
    (marked static, for the captured steps) or their first ``slots`` slots. The views share each layer's write
    pointer (``cumulative_length``, the same tensor), so either cache moves both; the layers are shallow copies with
    their key/value tensors and sizes replaced."""
    from transformers.cache_utils import Cache

    layers = []
    for layer in cache.layers:
        view = copy.copy(layer)
        if layer.is_initialized and rows is not None:
            view.keys, view.values = static_rows(layer.keys, rows), static_rows(layer.values, rows)
            for name in ("batch_size", "max_batch_size"):  # the attribute's name differs between releases
                if hasattr(view, name):
                    setattr(view, name, rows)
        if layer.is_initialized and slots is not None:
            view.keys, view.values, view.max_cache_len = view.keys[:, :, :slots], view.values[:, :, :slots], slots
        layers.append(view)
    return Cache(layers=layers)


def grown(t: torch.Tensor, dim: int, keep: int, size: int, fill: int = 0) -> torch.Tensor:
    """A new static tensor like ``t`` whose size along ``dim`` is ``size``: ``t``'s first ``keep`` entries there,
    then ``fill``."""
    out = t.new_full((*t.shape[:dim], size, *t.shape[dim + 1:]), fill)
    out.narrow(dim, 0, keep).copy_(t.narrow(dim, 0, keep))
    torch._dynamo.mark_static_address(out)
    return out


def grown_cache(cache, slots: int):
    """An HF ``Cache`` whose ``StaticLayer``s have ``slots`` slots and hold ``cache``'s stored ones first: new key
    and value tensors (marked static), the same write pointers (``cumulative_length``); shallow copies of the
    layers, as in ``cache_view``. The engine's cache grows this way as its rows commit tokens
    (``FixedStorage.reserve``)."""
    from transformers.cache_utils import Cache

    layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        new.max_cache_len = slots
        if layer.is_initialized:
            new.keys, new.values = (grown(t, 2, t.shape[2], slots) for t in (layer.keys, layer.values))
        layers.append(new)
    return Cache(layers=layers)
