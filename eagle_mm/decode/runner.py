"""How the engine's steps run: eagerly, captured as CUDA graphs, or compiled by inductor (and then captured).

A call's ``mode`` (``options.choose_mode``) says how: None runs each step eagerly (a CPU, a target split over devices,
warpers that cannot be captured); "graphs" captures each step's eager kernels as a CUDA graph (``graphs.OwnGraph``:
no compiler, so a first call costs two runs of a step, not a compile); a ``torch.compile`` mode compiles the steps
where fusing pays (``step_mode``), kept on disk whole (``compiled.DiskCompiled``), and captures them where the mode
asks for CUDA graphs. A ``Runner`` belongs to one decoder and keeps one wrapper per (step, mode) between calls: a
captured graph is bound to the decoder's buffers, and a later call of the same shapes replays it.

``begin`` resolves each step for the call: afterwards ``runner.verify(...)`` is the verify as it runs in this call
(the step function itself when eager, so an eager cycle pays nothing for the choice). A captured step is captured in
the call that first meets its signature: its first run is the warm-up, then what it wrote in place is put back (its
undo, ``_undos``) and the capture runs it again.
"""
from __future__ import annotations

import logging
from functools import partial

from ..hf.cache import layer_rows, pointers, set_pointers
from .compiled import DiskCompiled
from .graphs import OwnGraph, nothing_to_undo
from .steps import accept_step, advance_step, draft_step, prefill_step, update_step, verify_step

logger = logging.getLogger(__name__)

__all__ = ["Runner", "step_mode", "COMPILE_MODES", "CUDA_GRAPH_MODES", "STEPS"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_NO_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
STEPS = {"prefill": prefill_step, "draft": draft_step, "verify": verify_step, "accept": accept_step,
         "update": update_step, "advance": advance_step}

# What compile=True compiles: the target's verify forward, where fusing its many small kernels pays most, and the
# update. The draft's unrolled levels are the slowest to compile: only the "max-autotune" modes, which ask for
# speed at any compile time, compile it too. Measured on the H200 (bf16): code-tiny's cold first call 15.5 s with
# the verify alone, 23-27 s with the update, 70 s with the draft too; the 8B-shaped cycle 9.4, 8.7 and 7.45 ms.
# The prefill runs once per call, and compiling it would cost every new prompt bucket a compile: never compiled.
_COMPILED_STEPS = ("verify", "update")
_MAX_COMPILED_STEPS = ("verify", "update", "draft")


def step_mode(step: str, mode: str | None) -> str | None:
    """How ``step`` runs under the call's ``mode``: compile modes compile only ``_COMPILED_STEPS`` (the "max-autotune"
    modes ``_MAX_COMPILED_STEPS``); the other steps are captured as they are when the mode captures CUDA graphs (it
    does on CUDA), else run eagerly."""
    compiled = _MAX_COMPILED_STEPS if mode is not None and mode.startswith("max-autotune") else _COMPILED_STEPS
    if mode in (None, "graphs") or step in compiled:
        return mode
    return "graphs" if mode in CUDA_GRAPH_MODES else None


class Runner:
    """A decoder's steps as its calls run them. After ``begin``: ``prefill``, ``draft``, ``verify``, ``accept`` and
    ``update`` (``advance`` after a cycle without a tree), each the step of ``STEPS`` (``steps.py``) eager, captured or
    compiled as the call's mode says."""

    def __init__(self):
        self.mode: str | None = None
        self._wrapped: dict = {}  # (step, mode) -> the step as it runs
        self._dropped = (0.0, 0)  # setup seconds and captures of the wrappers ``reset`` dropped: the totals never fall

    def begin(self, mode: str | None, storage, device) -> None:
        """Resolve every step for a call of ``mode`` over ``storage`` on ``device``."""
        self.mode = mode
        undos = _undos(storage)
        for step, fn in STEPS.items():
            run = self._wrapper(step, fn, device)
            if isinstance(run, OwnGraph):
                run.undo = undos[step]
            setattr(self, step, run)

    def _wrapper(self, step: str, fn, device):
        mode = step_mode(step, self.mode)
        if mode is None:
            return fn
        key = (step, mode)
        if key not in self._wrapped:
            what = f"{step} step"
            if mode == "graphs":  # the buffers are keyed by identity: the device is the decoder's
                self._wrapped[key] = OwnGraph(fn, what, device=device)
            elif mode in CUDA_GRAPH_MODES:
                self._wrapped[key] = OwnGraph(DiskCompiled(fn, what, _NO_GRAPHS[mode]), what, device=device)
            else:
                self._wrapped[key] = DiskCompiled(fn, what, mode)
            logger.debug("the %s runs with mode=%s", what, mode)
        return self._wrapped[key]

    @property
    def setup(self) -> float:
        """Seconds the steps have spent compiling, warming up and capturing, over all calls so far."""
        return self._dropped[0] + sum(w.setup for w in self._wrapped.values())  # a warm-up holds its compile

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far, over all steps."""
        return self._dropped[1] + sum(w.captures for w in self._wrapped.values() if isinstance(w, OwnGraph))

    def graphs(self, step: str) -> int:
        """Signatures of ``step`` its CUDA-graph wrapper keeps (one graph each, once captured)."""
        return sum(w.signatures for (s, _), w in self._wrapped.items() if s == step and isinstance(w, OwnGraph))

    @property
    def compiled(self) -> dict[str, DiskCompiled]:
        """step -> its compiled function (``DiskCompiled``), for the steps that compile."""
        inner = {s: getattr(w, "inner", w) for (s, _), w in self._wrapped.items()}
        return {s: w for s, w in inner.items() if isinstance(w, DiskCompiled)}

    def reset(self) -> None:
        """Drop every wrapper: the memory their graphs were bound to is gone. What they spent stays counted (a call
        reads its setup as the difference of the totals before and after it: dropping it made that negative, and a
        call that captured everything again passed for one that captured nothing)."""
        self._dropped = (self.setup, self.captures)
        self._wrapped = {}


def _undos(storage) -> dict:
    """``OwnGraph``'s undo of each step: ``undo()`` snapshots what the step writes in place (as the storage stands
    when it runs, with the tree it runs) and returns the restore. The forwards write the slots at the write pointers,
    which a second run writes again, and move the pointers on from where the restore puts them back; the update
    reads and writes the verified slots, the kept ones of the positions and the head's cache, the root and the
    pointers; the advance one slot's position, the root and the pointers."""
    def forward(at_start: bool):
        return lambda: partial(set_pointers, storage.target.cache, 0 if at_start else storage.cur)

    def update():
        target, buf, c, tree = storage.target, storage.buf, storage.cur, storage.tree
        q, k, every = tree.total_tokens + 1, tree.depth + 1, slice(None)
        slices = [(t, (every, every, slice(c, c + q))) for t in layer_rows(target.cache)]
        slices += [(t, (every, slice(c, c + k))) for t in (target.pos, buf.head.pos)]
        slices += [(t, (every, every, slice(c, c + k))) for t in (buf.head.k, buf.head.v)]
        return _restore(slices + [(t, ...) for t in (buf.root_out, buf.root_logits)] + _moved(storage))

    def advance():
        return _restore([(storage.target.pos, (slice(None), slice(storage.cur, storage.cur + 1)))] + _moved(storage))

    return {"prefill": forward(True), "verify": forward(False), "draft": nothing_to_undo, "accept": nothing_to_undo,
            "update": update, "advance": advance}


def _moved(storage) -> list:
    """What every update moves on: the pointers and the root."""
    buf = storage.buf
    return [(t, ...) for t in (buf.cur, buf.root, buf.root_pos, *pointers(storage.target.cache))]


def _restore(slices: list):
    """A snapshot of the ``(tensor, index)`` slices; returns the function that writes them back."""
    saved = [(t, i, t[i].clone()) for t, i in slices]

    def restore():
        for t, i, v in saved:
            t[i] = v
    return restore
