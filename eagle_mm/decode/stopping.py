"""Where ``generate()``'s stopping criteria stop a row, for a block of new tokens at once.

A speculative cycle commits several tokens; ``generate()`` would have asked its criteria after each one. Calling
them once per token costs a few tensor ops each time, which on a fast GPU path is a measurable share of the
cycle (about 0.25 ms per token on the H200's 8B benchmark, bench/results/). The criteria generate() builds
itself answer a whole block in one step: the length limit fires at a known length, end-of-sequence at the first
EOS token, the time limit now or never within one block. Any other criterion (stop strings, user criteria) is
still called on every prefix, in order, so the first prefix that stops is the same as generate()'s.
"""
from __future__ import annotations

import weakref

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

__all__ = ["first_stop", "block_stops"]


def first_stop(criteria, seq: torch.Tensor, start: int) -> int | None:
    """seq (1, L): a row's prompt, generated tokens and n = L - start new ones. Returns the first i in [0, n) for
    which ``criteria`` stop on ``seq[:, :start + i + 1]`` (as generate() would see it), or None."""
    n = seq.shape[1] - start
    stop = n  # the earliest stop found so far (n: none)
    others = []
    for c in criteria or ():
        kind = type(c)  # exact types: a subclass may answer differently
        if kind is MaxLengthCriteria:  # fires once the length reaches max_length
            stop = min(stop, max(0, c.max_length - start - 1))
        elif kind is EosTokenCriteria:  # fires on an EOS token as the last one
            hit = torch.isin(seq[0, start:start + stop], _eos_ids(c, seq.device)).nonzero()
            if hit.numel():
                stop = int(hit[0])
        elif kind is MaxTimeCriteria:  # the clock does not depend on the tokens: now for all, or for none
            if bool(c(seq, None).any()):
                stop = 0
        else:
            others.append(c)
    for i in range(stop if others else 0):
        prefix = seq[:, : start + i + 1]
        if any(bool(c(prefix, None).any()) for c in others):
            return i
    return stop if stop < n else None


def block_stops(criteria, lengths: list[int], blocks: list[list[int]]) -> list[int | None] | None:
    """``first_stop`` for every row of a cycle at once, from the host's lists: row i's block ``blocks[i]`` follows
    ``lengths[i]`` tokens. None when some criterion must see each prefix (stop strings, user criteria): then
    ``first_stop`` asks them row by row. What it saves is a tensor and a few ops per row and cycle, which at a
    batch of 64 cost more than a GPU's cycle."""
    limit, eos, late = None, set(), False
    for c in criteria or ():
        kind = type(c)
        if kind is MaxLengthCriteria:
            limit = c.max_length if limit is None else min(limit, c.max_length)
        elif kind is EosTokenCriteria:
            eos |= _eos_set(c)
        elif kind is MaxTimeCriteria:
            late = late or bool(c(torch.zeros(1, 1, dtype=torch.long), None).any())
        else:
            return None
    out = []
    for n, toks in zip(lengths, blocks):
        stop = 0 if late else len(toks) if limit is None else min(len(toks), max(0, limit - n - 1))
        if eos:
            stop = next((i for i, t in enumerate(toks[:stop]) if t in eos), stop)
        out.append(stop if stop < len(toks) else None)
    return out


def _eos_set(criterion) -> set[int]:
    """The criterion's EOS ids as host ints, read once per criterion (a read on every cycle would wait for the work
    queued on the GPU)."""
    ids = _EOS_SETS.get(criterion)
    if ids is None:
        ids = _EOS_SETS[criterion] = set(criterion.eos_token_id.flatten().tolist())
    return ids


_EOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_EOS_SETS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _eos_ids(criterion, device: torch.device) -> torch.Tensor:
    """The criterion's EOS ids on ``device``, copied once per criterion: generate() keeps them on the model's GPU,
    and a copy to the host on every cycle would wait for the work queued on that GPU (the next draft)."""
    ids = _EOS.get(criterion)
    if ids is None or ids.device != device:
        ids = _EOS[criterion] = criterion.eos_token_id.to(device)
    return ids
