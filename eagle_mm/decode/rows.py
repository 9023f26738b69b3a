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

``target.cache.cache_view(slots=n)`` is the same kind of view along the slots: the eager engine (the CPU) runs each
forward over the cache slots in use, where a captured graph needs the whole preallocated length.
"""
from __future__ import annotations

import torch

__all__ = ["plan", "move_rows"]


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
