"""Narrows the H100 matrix's crash ("unspecified launch failure" in the prefill graph's replay at sampled batch 64's
first call, after the nine rows before it, with HF static generate in the same process; dev/results/run2, ab7, ab10,
ab12): runs bench_matrix.py's main with
  --eager-prefill  the prefill step eager under CUDA graphs (the other steps captured as ever);
  --trace          a log line (stderr) per prefill graph lookup (new signature or replay, the storage's generation and
                   cache address, the allocator's cudaFree count and retries) and per decoder begin (generation before
                   and after, cache slots).
  --check          at every replay of any step's graph, the addresses of the tensors inside the objects the graph is
                   keyed on by identity (the storage's Target and Buffers, their HF cache's layers and write pointers,
                   the model's and head's parameters and buffers) against those at its capture: a graph bound to
                   memory that moved reads freed memory, which faults once the allocator hands it to the driver.
    python dev/gpu/crash_probe.py [--eager-prefill] [--trace] [--check] -- <bench_matrix.py arguments>
"""
import dataclasses
import logging
import runpy
import sys

import torch

import eagle_mm.decode.decoder as decoder
import eagle_mm.decode.graphs as graphs
import eagle_mm.decode.prefill as prefill
import eagle_mm.decode.runner as runner

log = logging.getLogger("crash_probe")


def _trace() -> None:
    begin, call = decoder.Decoder.begin, graphs.OwnGraph._call

    def traced_begin(self, tree, mode, batch, prompt_len, max_length, sampler=None, *, capacity=None):
        g0 = self.storage.generation
        begin(self, tree, mode, batch, prompt_len, max_length, sampler, capacity=capacity)
        s = self.storage
        log.warning("begin batch=%d prompt=%d max=%d sampled=%s tree=%s cap=%s gen %d->%d slots=%d", batch, prompt_len,
                    max_length, sampler is not None, tree, capacity, g0, s.generation, s.length)

    def traced_call(self, args, sig, undo=None):
        if self.what == "prefill step":
            target = args[1]
            layer = target.cache.layers[0]
            ptr = layer.keys.data_ptr() if layer.is_initialized else None
            m = torch.cuda.memory_stats()
            log.warning("prefill %s keys@%s graphs=%d device_frees=%s retries=%s reserved=%.1fG",
                        "replay" if sig.key in self._graphs else "new", ptr, len(self._graphs),
                        m.get("num_device_free"), m.get("num_alloc_retries"), torch.cuda.memory_reserved() / 2**30)
        return call(self, args, sig, undo)

    decoder.Decoder.begin, graphs.OwnGraph._call = traced_begin, traced_call


def _addresses(obj, path: str, out: dict, seen: set) -> None:
    """path -> data_ptr of every tensor reachable from obj through dataclass fields, HF cache layers, module
    parameters and buffers, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        out[path] = obj.data_ptr()
        return
    if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        for n, t in list(obj.named_parameters()) + list(obj.named_buffers()):
            out[f"{path}.{n}"] = t.data_ptr()
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _addresses(getattr(obj, f.name), f"{path}.{f.name}", out, seen)
    elif hasattr(obj, "layers") and type(obj).__name__.endswith("Cache"):
        for i, layer in enumerate(obj.layers):
            for n in ("keys", "values", "cumulative_length"):
                t = getattr(layer, n, None)
                if isinstance(t, torch.Tensor):
                    out[f"{path}.layers[{i}].{n}"] = t.data_ptr()
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _addresses(v, f"{path}[{i}]", out, seen)


def _snapshot(args) -> dict:
    out: dict = {}
    seen: set = set()
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            _addresses(a, f"arg{i}", out, seen)
    return out


def _check() -> None:
    capture, call = graphs.OwnGraph._capture, graphs.OwnGraph._call
    counts = {"replays": 0, "moved": 0}

    def checked_capture(self, args, sig):
        entry = capture(self, args, sig)
        entry.probe = _snapshot(args)
        return entry

    def checked_call(self, args, sig, undo=None):
        entry = self._graphs.get(sig.key)
        if isinstance(entry, graphs._Captured) and hasattr(entry, "probe"):
            counts["replays"] += 1
            now = _snapshot(args)
            moved = [k for k, v in entry.probe.items() if now.get(k) != v]
            if moved:
                counts["moved"] += 1
                log.warning("STALE %s replay: %d of %d addresses moved since its capture, e.g. %s", self.what,
                            len(moved), len(entry.probe), moved[:6])
            if counts["replays"] % 2000 == 0:
                log.warning("check: %d replays checked, %d with moved addresses", counts["replays"], counts["moved"])
        return call(self, args, sig, undo)

    graphs.OwnGraph._capture, graphs.OwnGraph._call = checked_capture, checked_call


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    args = sys.argv[1:]
    if "--eager-prefill" in args:
        plain = runner.step_mode

        def step_mode(step, mode):
            return None if step == "prefill" and mode == "graphs" else plain(step, mode)
        runner.step_mode = prefill.step_mode = step_mode
    if "--check" in args:
        _check()
    if "--trace" in args:
        _trace()
    args = [a for a in args if a not in ("--eager-prefill", "--trace", "--check")]
    if args and args[0] == "--":
        args = args[1:]
    sys.argv = ["bench/bench_matrix.py"] + args
    runpy.run_path("bench/bench_matrix.py", run_name="__main__")
