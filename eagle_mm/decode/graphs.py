"""The engine's CUDA graphs: one ``torch.cuda.CUDAGraph`` per input signature, around an eager or compiled function
(``runner.py`` decides which steps run this way).

Why not inductor's CUDA graph trees (``torch.compile(mode="reduce-overhead")``): every call of a graph-tree
function runs dynamo's guards, checks the static inputs, copies the others and rebuilds the outputs in Python.
For the 8B verify forward that was 1.0 ms of host time per call, which the decode cycle waited for; launched
from here it takes 0.2 ms, and the cycle 6.7 ms instead of 7.2
(bench/results/bench_8b_owngraphs_h200_2026-11-30.json).
A replay is a dict lookup, one ``copy_`` per argument tensor whose address changed, and ``graph.replay()``.

The contract, the same as the graph trees':
- Tensors marked with ``torch._dynamo.mark_static_address`` (and parameters) are used in place: the graph is
  bound to their address, which is part of the signature, so a new buffer gets a new graph. Every tensor the
  function writes in place must be marked: other argument tensors are copied into buffers the graph owns, so a
  write to them would be lost.
- The outputs are the graph's own memory, rewritten by its next replay: read them before calling again.
- Python side effects run only when the function really runs: at the first call of a signature (the warm-up,
  which compiles it) and at the capture (the second). Replays run kernels only, so the function must return
  everything the caller needs.
Objects that are not tensors are part of the signature: plain values (and frozen dataclasses) by value, any other
object by identity, checked through a weak reference so that a new object at a dead one's address is not taken
for it. A frozen dataclass compared by identity (``eq=False``: the storage's ``Target`` and ``Buffers``) is keyed
so too, without looking inside: every tensor it holds must be static and never replaced (the storage makes a new
object for new memory). ``unkeyed`` positions are left out of the signature and passed as they are:
the graph must not depend on them, and they must hold no tensors.

Threads: decoders of one model (two heads), or of two models, may run in two threads on one GPU. A capture in one
thread must neither fail on the other thread's CUDA work (a replay, an eager step, a host read) nor take it in:
captures run in CUDA's "thread_local" capture mode (only the capturing thread's unsafe calls are refused; what
another thread launches on its own stream is not captured), and one at a time in the process (``_CAPTURING``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from ..hf.dynamo import is_static
from .signature import Signature, alive

logger = logging.getLogger(__name__)

__all__ = ["OwnGraph", "nothing_to_undo", "MAX_GRAPHS"]

# Signatures kept per function; the oldest graph (and its memory pool) is dropped first. A call's path of batches
# (16, 8, 4, 2, 1 as rows finish) times the trees the chooser moves between held more than 8: an H100 matrix at
# greedy batch 16 captured again in every call (dev/results/ab6_h100_2026-12-06). One memory pool shared by a
# function's graphs would hold one graph's scratch memory instead of one per graph, but an H100 run with it failed
# ("unspecified launch failure", sampled batch 64, dev/results/ab7_h100_2026-12-06): each graph keeps its own.
MAX_GRAPHS = 16
_CAPTURING = threading.Lock()  # held by the one capture underway in this process (a lock, not a table: no state)


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, out, buffers: list[torch.Tensor], refs: list):
        self.graph, self.out, self.buffers, self.refs = graph, out, buffers, refs


class OwnGraph:
    """``OwnGraph(torch.compile(fn, mode="default"), "what")(*args)``: runs ``fn`` at the first call of each
    signature, captures it at the second, replays the capture from then on, on the GPU of its first CUDA tensor
    argument, else on ``device`` (a function whose tensors all sit in arguments keyed by identity, say); a call with
    neither just runs the compiled function."""

    def __init__(self, inner, what: str, unkeyed: tuple[int, ...] = (), undo=None, device=None):
        self.inner, self.what, self.unkeyed, self.undo = inner, what, frozenset(unkeyed), undo
        self.device = torch.device(device) if device is not None and torch.device(device).type == "cuda" else None
        self._graphs: OrderedDict = OrderedDict()  # key -> _Captured, or a list of refs after the warm-up call
        self.captures = 0  # graphs captured so far (tests read it)
        self.setup = 0.0  # seconds spent in warm-up calls and captures
        self.failed: str | None = None  # why a capture failed: then every call just runs ``inner``

    @property
    def signatures(self) -> int:
        """Signatures kept (captured, or run once and waiting for their capture)."""
        return len(self._graphs)

    def __call__(self, *args, undo=None):
        """``undo`` (default: the ``undo`` given at construction): for a signature not seen yet, capture it in this
        call: ``undo()`` snapshots what the function writes and returns a callable that restores it; the warm-up
        runs, the snapshot is restored, and the capture runs and replays (the function's effect happens once).
        Without it, the capture waits for the second call of the signature (a step that runs once per call, or last
        in a call, would then be captured by the next call)."""
        sig = Signature(args, self.unkeyed)  # unkeyed arguments hold no tensors (the contract)
        device = sig.device if sig.device is not None else self.device
        if device is None:
            return self.inner(*args)
        with torch.cuda.device(device):  # capture and replay on the arguments' GPU, whichever is current
            return self._call(args, sig, undo if undo is not None else self.undo)

    def _call(self, args: tuple, sig: Signature, undo=None):
        entry = self._graphs.get(sig.key)
        if entry is not None and not alive(entry.refs if isinstance(entry, _Captured) else entry, sig.refs):
            del self._graphs[sig.key]  # an object it was keyed on died; this one merely reuses its id
            entry = None
        if entry is None:  # first call: compile and run (the warm-up); capture now (undo) or at the next call
            entry = self._graphs[sig.key] = sig.refs
            self._graphs.move_to_end(sig.key)
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
            t0 = time.perf_counter()
            restore = undo() if undo is not None and not self.failed else None
            out = self.inner(*args)
            self.setup += time.perf_counter() - t0
            if restore is None or sig.key not in self._graphs:
                return out
            restore()  # the warm-up's writes undone: the capture's replay makes them once
        self._graphs.move_to_end(sig.key)
        if self.failed:
            return self.inner(*args)
        if isinstance(entry, _Captured):
            for src, dst in zip(sig.transient, entry.buffers):
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
        else:
            t0 = time.perf_counter()
            try:
                entry = self._graphs[sig.key] = self._capture(args, sig)
            except Exception as e:  # any capture failure: this function runs without graphs from now on
                self.failed = f"{type(e).__name__}: {e}"
                logger.warning("capturing the %s as a CUDA graph failed (%s); it runs without CUDA graphs",
                               self.what, str(e).splitlines()[0] if str(e) else type(e).__name__)
                torch.cuda.synchronize()
                return self.inner(*args)
            finally:
                self.setup += time.perf_counter() - t0
        entry.graph.replay()
        return entry.out

    def _capture(self, args: tuple, sig: Signature) -> _Captured:
        buffers: list[torch.Tensor] = []
        clones: dict[int, torch.Tensor] = {}

        def own(x):  # the transient tensors, cloned into buffers the graph reads from (same traversal order)
            if isinstance(x, torch.Tensor):
                if is_static(x):
                    return x
                if id(x) not in clones:  # an alias stays an alias: else dynamo's guards fail and it recompiles
                    clones[id(x)] = x.clone()
                    buffers.append(clones[id(x)])
                return clones[id(x)]
            if isinstance(x, (list, tuple)):
                return type(x)(own(v) for v in x)
            return x

        owned = tuple(a if i in self.unkeyed else own(a) for i, a in enumerate(args))
        graph = torch.cuda.CUDAGraph()
        with _CAPTURING, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self.inner(*owned)
        self.captures += 1
        logger.debug("captured a CUDA graph of the %s (%d so far)", self.what, self.captures)
        return _Captured(graph, out, buffers, sig.refs)


def nothing_to_undo():
    """``OwnGraph``'s ``undo`` for a function whose second run repeats its first exactly (it writes only what it
    computes from inputs it does not write)."""
    return lambda: None
