"""The one timing harness of the benchmarks: warm-up, the first call apart, device and wall timings, one results file.

Every method is timed the same way: its first call alone (`timed_call`: compilation, autotuning, allocator
growth; reported as its own row), then untimed warm-up calls, then the timed calls (`wall_s` on the host clock,
synchronized; `gpu_us` as CUDA-graph replay, the device time without launch overhead). With ``--record``
(`add_record_arg`), `record` appends one JSON line per result to bench/results.jsonl, with the machine, the
versions and the date, so that runs accumulate in one file that the docs' tables cite.
"""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().with_name("results.jsonl")


def sync(device=None) -> None:
    """Wait for every GPU (a no-op for a CPU ``device``), so that a host clock covers the work launched, also on a
    model split over several GPUs."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def timed_call(fn, *args, device=None):
    """(result, seconds) of one call of fn, the device synchronized before and after. A method's first call timed
    so is its one-time cost (compilation, autotuning, allocator growth), reported apart from its warm calls."""
    sync(device)
    t = time.perf_counter()
    out = fn(*args)
    sync(device)
    return out, time.perf_counter() - t


def wall_s(fn, *args, warmup: int = 1, repeats: int = 3, device=None) -> float:
    """Mean wall-clock seconds per call over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn(*args)
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    sync(device)
    return (time.perf_counter() - t) / repeats


def gpu_us(fn, inputs: list, replays: int = 20) -> float:
    """Device microseconds per call: one CUDA graph calls fn on each input tuple in turn (give enough copies
    that they outgrow the L2, see `rotating_copies`), replayed ``replays`` times after two untimed warm-up calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs[:2]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for args in inputs:
            fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(inputs))


def rotating_copies(t: torch.Tensor) -> int:
    """How many copies of t a timed graph should cycle through: at least 2, and 4x the L2 in all."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return max(2, -(-4 * l2 // (t.numel() * t.element_size())))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), from 2 GiB copies: the memory floor's divisor."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * src.element_size() / (start.elapsed_time(end) * 1e-3)


def environment() -> dict:
    """Where and when: UTC date, machine, versions, the repository's commit."""
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": gpu or f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton_version, "commit": commit}


def add_record_arg(parser) -> None:
    """``--record [PATH]``: append the results to PATH (bench/results.jsonl when given bare); off by default, so
    that test runs of a benchmark leave the committed file alone."""
    parser.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="PATH",
                        help=f"append the results as JSON lines to PATH (default {RESULTS.parent.name}/{RESULTS.name})")


def record(bench: str, rows: list[dict], *, command: str, path: Path | str | None) -> list[dict]:
    """One dict per row: bench name, command, environment, then the row's own fields; appended to ``path`` as JSON
    lines unless it is None. Returns the dicts."""
    env = environment()
    lines = [{"bench": bench, "command": command, **env, **row} for row in rows]
    if path is not None:
        with open(path, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return lines
