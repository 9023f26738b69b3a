"""Benchmark fused greedy tree verification on a CUDA GPU.

For each tree size N and vocabulary V (bf16 logits (B, N+1, V)) it times the Triton kernel in its two
variants (two launches, the default; and fused=True, one launch with per-row ticket counters), the torch
reference (argmax + greedy_accept + path_indices), torch.argmax alone, and the memory floor: the bytes
of logits read once over the device's measured copy bandwidth. Two timings per function:
  gpu: CUDA-graph replay of calls over rotating copies of the inputs (more bytes than the L2 holds),
       so no launch overhead and no L2 reuse: the device time.
  eager: wall clock per call over back-to-back calls: what an un-graphed decode loop pays (host included).
Every Triton variant is checked bit-exact against the reference (bit_exact_two_launch, bit_exact_fused;
the fused one again after its timings, which proves its counters were reset call after call; with
--tilings, tilings_not_exact lists any tiling that differs); the exit status is 1 if any differs.
Prints a markdown table; --out writes JSON. Run from the repository root with the package importable
(pip install -e . or PYTHONPATH=.):

    python bench/bench_verify.py --out verify.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The logits shapes swept by both verify benchmarks (this one and bench_verify_sampling.py)."""
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 128], help="draft nodes N (the tree has N+1)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 152064])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--depth", type=int, default=8, help="max tree depth D")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--tilings", action="store_true",
                   help="also time block_v x num_warps x programs/SM x fused x unroll x walk-warps variants")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def random_tree(B: int, n: int, max_depth: int, gen: torch.Generator):
    """parent, depth (B, n) of random trees of n nodes (root included), depth <= max_depth; each node hangs
    below one of the 4 newest nodes that may still grow, so the trees get deep."""
    parent = torch.zeros(B, n, dtype=torch.long)
    depth = torch.zeros(B, n, dtype=torch.long)
    for b in range(B):
        for i in range(1, n):
            ok = (depth[b, :i] < max_depth).nonzero().flatten()
            p = ok[torch.randint(max(0, len(ok) - 4), len(ok), (1,), generator=gen)].item()
            parent[b, i], depth[b, i] = p, depth[b, p] + 1
    return parent, depth


def make_tree(B: int, n: int, V: int, max_depth: int, gen: torch.Generator):
    """Random tree of n nodes (root included), depth <= max_depth, with one planted accepted path."""
    parent, depth = random_tree(B, n, max_depth, gen)
    tokens = torch.randint(0, V, (B, n), generator=gen)
    logits = torch.randn(B, n, V, generator=gen)
    for b in range(B):
        node = n - 1
        while node != 0:
            logits[b, parent[b, node], tokens[b, node]] = 10.0
            node = parent[b, node].item()
    return logits.to(torch.bfloat16), tokens, parent, depth


def read_kernel():
    """A Triton kernel that only reads: each program streams a slice of the flat logits and stores its max
    (no index, no tree). Its time in this harness is what any one kernel reading these bytes pays here
    (launch, ramp-up, tail included): the practical floor, beside the bandwidth floor."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read_max(x_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        acc = tl.full((BLOCK,), float("-inf"), tl.float32)
        lo = pid.to(tl.int64) * chunk
        for start in range(0, chunk, BLOCK):
            idx = lo + start + lanes
            acc = tl.maximum(acc, tl.load(x_ptr + idx, mask=idx < n, other=float("-inf")).to(tl.float32))
        tl.store(out_ptr + pid, tl.max(acc, axis=0))

    def read(logits, *_, programs: int = 1056, block: int = 2048):
        n = logits.numel()
        chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
        grid = triton.cdiv(n, chunk)
        out = torch.empty(grid, dtype=torch.float32, device=logits.device)
        _read_max[(grid,)](logits, out, n, chunk, BLOCK=block, num_warps=8)
        return out

    return read


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), from 2 GiB copies."""
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


def gpu_us(fn, inputs: list, replays: int = 20) -> float:
    """Device time per call: one CUDA graph calls fn on each input set in turn, replayed ``replays`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs[:2]:  # warm up (compile, allocator) outside the capture
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
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


def eager_us(fn, args, calls: int = 200) -> float:
    """Wall clock per call, back to back, one sync at the end: host launch cost included."""
    for _ in range(10):
        fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_verify.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to time.",
              file=sys.stderr)
        return 2
    import triton

    from eagle_mm.kernels.reference import verify_greedy_reference
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton

    read = read_kernel()
    bw = copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    gen = torch.Generator().manual_seed(0)
    D = args.depth
    rows = []
    for N in args.nodes:
        for V in args.vocab:
            case = tuple(t.cuda() for t in make_tree(args.batch, N + 1, V, D, gen))
            logits = case[0]
            copies = max(2, -(-4 * l2 // (logits.numel() * logits.element_size())))  # >= 4x the L2 in all
            inputs = [(logits.clone(), *case[1:]) for _ in range(copies)]
            want = verify_greedy_reference(*case, D, with_path=True)

            def exact(**kw) -> bool:
                got = verify_greedy_triton(*case, D, with_path=True, **kw)
                return all(torch.equal(g, w) for g, w in zip(got, want))

            def triton_fn(*a, **kw):
                return verify_greedy_triton(*a, D, with_path=True, **kw)

            def fused_fn(*a, **kw):
                return verify_greedy_triton(*a, D, with_path=True, fused=True, **kw)

            def ref_fn(*a):
                return verify_greedy_reference(*a, D, with_path=True)

            def argmax_fn(lg, *_):
                return lg.argmax(-1)

            row = {"B": args.batch, "N": N, "V": V, "D": D, "bit_exact_two_launch": exact(),
                   "bit_exact_fused": exact(fused=True), "accept_len": want[0].tolist(),
                   "floor_us": logits.numel() * logits.element_size() / bw * 1e6}
            for name, fn in (("triton", triton_fn), ("triton_fused", fused_fn), ("torch_ref", ref_fn),
                             ("argmax", argmax_fn), ("read_only", read)):
                row[f"{name}_gpu_us"] = gpu_us(fn, inputs)
                row[f"{name}_eager_us"] = eager_us(fn, case)
            # The read-only kernel's best grid: the practical floor of one kernel over these bytes.
            row["read_only_best_gpu_us"] = min(
                gpu_us(lambda lg, *_, p=p, b=b: read(lg, programs=p, block=b), inputs)
                for p in (264, 528, 1056, 2112) for b in (1024, 2048, 4096))
            # Again after hundreds of fused calls and graph replays: right only if every call reset its counters.
            row["bit_exact_fused"] &= exact(fused=True)
            row["bit_exact"] = row["bit_exact_two_launch"] and row["bit_exact_fused"]
            if args.tilings:  # 96 variants: 32 compiles, then one graph each
                row["tilings_gpu_us"], row["tilings_not_exact"], row["tilings_failed"] = {}, [], {}
                for bv, w, p, f, u, ww in itertools.product((1024, 2048), (4, 8), (2, 4, 8), (False, True), (1, 2),
                                                            (1, 4)):
                    if f and ww != 1:  # fused: the walk runs in the argmax program's warps
                        continue
                    kw = {"block_v": bv, "num_warps": w, "programs_per_sm": p, "fused": f, "unroll": u}
                    if not f:
                        kw["walk_warps"] = ww
                    name = ",".join(f"{k}={v}" for k, v in kw.items())
                    try:
                        row["tilings_gpu_us"][name] = gpu_us(lambda *a, kw=kw: triton_fn(*a, **kw), inputs)
                        ok = exact(**kw)
                    except Exception as err:  # a tiling Triton cannot compile is recorded, not fatal
                        row["tilings_failed"][name] = f"{type(err).__name__}: {str(err)[:200]}"
                        continue
                    if not ok:
                        row["tilings_not_exact"].append(name)
                        row["bit_exact"] = False
            del inputs
            rows.append(row)
            print(f"N={N} V={V}: triton {row['triton_gpu_us']:.1f} us gpu / {row['triton_eager_us']:.1f} us eager, "
                  f"fused {row['triton_fused_gpu_us']:.1f} / {row['triton_fused_eager_us']:.1f}, "
                  f"reference {row['torch_ref_gpu_us']:.1f} / {row['torch_ref_eager_us']:.1f}", file=sys.stderr)

    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name}, copy bandwidth {bw / 1e9:.0f} GB/s, B={args.batch}, D={D}, bf16 logits; "
          "gpu = CUDA-graph replay over rotating inputs, eager = wall clock per call\n")
    print("| N | V | floor us | triton gpu us | x floor | triton eager us | fused gpu us | fused x floor "
          "| fused eager us | torch ref gpu us | torch ref eager us | argmax gpu us | argmax eager us "
          "| read-only gpu us (best grid) | exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} | {r['V']} | {r['floor_us']:.1f} | {r['triton_gpu_us']:.1f} "
              f"| {r['triton_gpu_us'] / r['floor_us']:.2f} | {r['triton_eager_us']:.1f} "
              f"| {r['triton_fused_gpu_us']:.1f} | {r['triton_fused_gpu_us'] / r['floor_us']:.2f} "
              f"| {r['triton_fused_eager_us']:.1f} | {r['torch_ref_gpu_us']:.1f} "
              f"| {r['torch_ref_eager_us']:.1f} | {r['argmax_gpu_us']:.1f} | {r['argmax_eager_us']:.1f} "
              f"| {r['read_only_best_gpu_us']:.1f} | {r['bit_exact']} |")
    if args.out:
        meta = {"device": props.name, "copy_bandwidth_GBps": bw / 1e9, "torch": torch.__version__,
                "triton": triton.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
