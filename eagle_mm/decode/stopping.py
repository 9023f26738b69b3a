"""Where ``generate()``'s stopping criteria stop a row, for a block of new tokens at once.

A speculative cycle commits several tokens; ``generate()`` would have asked its criteria after each one. Calling
them once per token costs a few tensor ops each time, which on a fast GPU path is a measurable share of the
cycle (about 0.25 ms per token on the H200's 8B benchmark, bench/results/). The criteria generate() builds
itself answer a whole block in one step: the length limit fires at a known length, end-of-sequence at the first
EOS token, the time limit now or never within one block. Any other criterion (stop strings, user criteria) is
still called on every prefix, in order, so the first prefix that stops is the same as generate()'s. When there are
none, ``block_stops`` answers every row of a cycle from the host's lists, with no tensor per row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..hf.generation import split_criteria

__all__ = ["Stops", "first_stop", "block_stops"]


@dataclass(frozen=True)
class Stops:
    """One call's stopping criteria, sorted once by how they answer (``split_criteria``)."""

    max_length: int | None  # the smallest length limit (a fractional one rounded up, as it fires), or None
    eos: torch.Tensor | None  # (E,) every EOS id, on the host, or None
    timers: tuple  # time limits: they stop every row now, or none
    others: tuple  # asked on every prefix
    eos_set: frozenset = frozenset()  # the EOS ids as host ints (``block_stops``)

    @classmethod
    def of(cls, criteria) -> "Stops":
        """Sort ``criteria``; generate() keeps the EOS ids on the model's device: they are copied to the host here,
        once per call (a copy on every cycle would wait for the work queued on that device)."""
        lengths, eos, timers, others = split_criteria(criteria)
        ids = torch.cat([e.flatten().cpu() for e in eos]) if eos else None
        return cls(min((math.ceil(n) for n in lengths), default=None), ids, tuple(timers), tuple(others),
                   frozenset(ids.tolist()) if ids is not None else frozenset())


def first_stop(stops: Stops, seq: torch.Tensor, start: int) -> int | None:
    """seq (1, L) on the host: a row's prompt, generated tokens and n = L - start new ones. Returns the first i in
    [0, n) for which the criteria stop on ``seq[:, :start + i + 1]`` (as generate() would see it), or None."""
    n = seq.shape[1] - start
    stop = n  # the earliest stop found so far (n: none)
    if stops.max_length is not None:  # fires once the length reaches max_length
        stop = min(stop, max(0, stops.max_length - start - 1))
    if stops.eos is not None:  # fires on an EOS token as the last one
        hit = torch.isin(seq[0, start:start + stop], stops.eos).nonzero()
        if hit.numel():
            stop = int(hit[0])
    if stops.timers and any(bool(c(seq, None).any()) for c in stops.timers):  # the clock: now for all, or none
        stop = 0
    for i in range(stop if stops.others else 0):
        prefix = seq[:, : start + i + 1]
        if any(bool(c(prefix, None).any()) for c in stops.others):
            return i
    return stop if stop < n else None


def block_stops(stops: Stops, lengths: list[int], blocks: list[list[int]]) -> list[int | None] | None:
    """``first_stop`` for every row of a cycle at once, from the host's lists: row i's new tokens ``blocks[i]`` follow
    ``lengths[i]`` tokens. None when a criterion must see each prefix (``stops.others``): ``first_stop`` then asks
    row by row. What it saves is a tensor and a few ops per row and cycle, which at a batch of 64 cost more than a
    GPU's cycle."""
    if stops.others:
        return None
    late = bool(stops.timers) and any(bool(c(torch.zeros(1, 1, dtype=torch.long), None).any()) for c in stops.timers)
    if late:
        return [0 if toks else None for toks in blocks]
    limit, eos = stops.max_length, stops.eos_set
    out = []
    for n, toks in zip(lengths, blocks):  # a row without EOS short of its limit costs two comparisons
        k = len(toks)
        stop = k if limit is None or limit - n - 1 >= k else max(0, limit - n - 1)
        if eos and not eos.isdisjoint(toks):
            stop = next((i for i, t in enumerate(toks[:stop]) if t in eos), stop)
        out.append(stop if stop < k else None)
    return out
