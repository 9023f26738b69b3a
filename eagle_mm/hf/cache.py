"""The target's KV cache as the engine keeps it: an HF ``Cache`` of ``StaticLayer``s, and what the engine does to it
that the public ``Cache`` API has no call for. Every read of a ``StaticLayer``'s fields is here.

A ``StaticLayer`` allocates its keys and values (B, h, L, d) at the first forward (its ``is_initialized``), on that
forward's device and dtype, and marks them as static addresses; a forward writes its Q new slots at the layer's write
pointer ``cumulative_length`` (a 0-d tensor) and moves it on by Q. The engine chooses where the pointer is before each
forward and writes the slots it keeps itself (``keep_slots``); transformers 5.17's ``StaticLayer`` has no ``crop``.
"""
from __future__ import annotations

import copy

import torch

from .dynamo import mark_static

__all__ = ["static_cache", "cache_slots", "filled_layers", "cache_view", "set_pointers", "pointers",
           "keep_slots", "layer_rows", "static_rows", "grown", "grown_cache"]


def static_cache(num_layers: int, slots: int):
    """An empty cache of ``num_layers`` static layers of ``slots`` slots each (allocated by the first forward)."""
    from transformers.cache_utils import Cache, StaticLayer

    return Cache(layers=[StaticLayer(max_cache_len=slots) for _ in range(num_layers)])


def cache_slots(cache) -> int:
    """Slots per layer (the preallocated length L)."""
    return cache.layers[0].max_cache_len


def filled_layers(cache) -> list:
    """The layers a forward has allocated (all of them after the first forward; none before)."""
    return [layer for layer in cache.layers if layer.is_initialized]


def layer_rows(cache) -> list[torch.Tensor]:
    """The allocated keys and values (B, h, L, d) of every layer: what moves when the engine reorders its rows."""
    layers = filled_layers(cache)
    return [la.keys for la in layers] + [la.values for la in layers]


def static_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of a static buffer, as a view at the buffer's address, marked static like it (a captured
    graph uses it in place)."""
    return mark_static(t[:n])


def cache_view(cache, rows: int | None = None, slots: int | None = None):
    """An HF ``Cache`` whose layers are views of ``cache``'s allocated layers: their first ``rows`` rows (marked
    static, for the captured steps) or their first ``slots`` slots. The views share each layer's write pointer (the
    same tensor), so either cache moves both; the layers are shallow copies with their tensors and sizes replaced."""
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


def set_pointers(cache, at: int | torch.Tensor) -> None:
    """Every allocated layer's write pointer to ``at``, in place (the next forward writes its slots from there)."""
    for layer in filled_layers(cache):
        if isinstance(at, int):
            layer.cumulative_length.fill_(at)
        else:
            layer.cumulative_length.copy_(at)


def pointers(cache) -> list[torch.Tensor]:
    """The allocated layers' write pointers (0-d tensors, written in place)."""
    return [layer.cumulative_length for layer in filled_layers(cache)]


def keep_slots(cache, src: torch.Tensor, dst: torch.Tensor, new_len: torch.Tensor) -> None:
    """In place, per allocated layer: slots dst (K,) <- slots src (B, K) of each row; the write pointer <- new_len."""
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for t in (layer.keys, layer.values):
            B, h, _, d = t.shape
            idx = src.to(t.device)[:, None, :, None].expand(B, h, -1, d)
            t.index_copy_(2, dst.to(t.device), t.gather(2, idx))  # gather first: source and target may overlap
        layer.cumulative_length.copy_(new_len)


def grown(t: torch.Tensor, dim: int, keep: int, size: int, fill: int = 0) -> torch.Tensor:
    """A new static tensor like ``t`` whose size along ``dim`` is ``size``: ``t``'s first ``keep`` entries there,
    then ``fill``."""
    out = t.new_full((*t.shape[:dim], size, *t.shape[dim + 1:]), fill)
    out.narrow(dim, 0, keep).copy_(t.narrow(dim, 0, keep))
    return mark_static(out)


def grown_cache(cache, slots: int):
    """An HF ``Cache`` whose layers have ``slots`` slots and hold ``cache``'s stored ones first: new key and value
    tensors (marked static), the same write pointers; shallow copies of the layers, as in ``cache_view``."""
    from transformers.cache_utils import Cache

    layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        new.max_cache_len = slots
        if layer.is_initialized:
            new.keys, new.values = (grown(t, 2, t.shape[2], slots) for t in (layer.keys, layer.values))
        layers.append(new)
    return Cache(layers=layers)
