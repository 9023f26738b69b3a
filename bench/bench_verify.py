"""Benchmark fused greedy tree verification on a CUDA GPU.

For each tree size N and vocabulary V (bf16 logits (B, N+1, V)) it times the Triton kernel with its defaults
(two launches; on sm_90+ the packed-pair argmax and the early-launched walk) and with fused=True (one launch,
per-row ticket counters), the torch reference (argmax + greedy_accept + path_indices), torch.argmax alone,
the memory floor (the bytes of logits read once over the device's measured copy bandwidth), and what any
kernel pays in this harness: a read-only Triton kernel over the same bytes (best of its grids), an empty
launch, and the walk launch alone. Two timings per function:
  gpu: CUDA-graph replay of calls over rotating copies of the inputs (more bytes than the L2 holds),
       so no launch overhead and no L2 reuse: the device time.
  eager: wall clock per call over back-to-back calls: what an un-graphed decode loop pays (host included).
--variant K=V,... times the kernel with other options at every shape; --tilings sweeps the argmax grid
(block_v x num_warps x programs/SM x loop) at each shape. Every Triton run is checked bit-exact against the
reference (bit_exact_two_launch, bit_exact_fused; the fused one again after its timings, which proves its
counters were reset call after call; tilings_not_exact lists any tiling that differs); the exit status is 1
if any differs. Prints a markdown table; --out writes JSON. Run from the repository root with the package
importable (pip install -e . or PYTHONPATH=.):

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
                   help="also time block_v x num_warps x programs/SM x argmax loop x pdl variants")
    p.add_argument("--variant", action="append", default=[], metavar="K=V,...",
                   help="also time the kernel with these options at every shape, e.g. tile=4,pdl=1 (repeatable)")
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
    def _read_max(x_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr, TILE: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, TILE)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # TILE chunks per load
        acc = tl.full((TILE, BLOCK), float("-inf"), tl.float32)
        lo = pid.to(tl.int64) * chunk
        for start in range(0, chunk, BLOCK * TILE):
            idx = lo + start + offs
            acc = tl.maximum(acc, tl.load(x_ptr + idx, mask=idx < n, other=float("-inf")).to(tl.float32))
        tl.store(out_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))

    def read(logits, *_, programs: int = 1056, block: int = 2048, tile: int = 1):
        n = logits.numel()
        chunk = triton.cdiv(triton.cdiv(n, programs), block * tile) * block * tile
        grid = triton.cdiv(n, chunk)
        out = torch.empty(grid, dtype=torch.float32, device=logits.device)
        _read_max[(grid,)](logits, out, n, chunk, BLOCK=block, TILE=tile, num_warps=8)
        return out

    return read


def empty_kernel():
    """One Triton program that stores one value: what a launch alone costs in this harness."""
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(out_ptr):
        tl.store(out_ptr, 1.0)

    def empty(logits):
        out = torch.empty(1, dtype=torch.float32, device=logits.device)
        _touch[(1,)](out)
        return out

    return empty


def walk_only(D: int, warps: int = 4):
    """The two-launch kernel's second launch alone (the tree walk), over keys from one earlier argmax."""
    from eagle_mm.kernels import triton_greedy as tg
    from eagle_mm.kernels.triton_walk import bits_fit, walk_consts
    import triton

    def walk(logits, tokens, parent, depth):
        B, n, _ = logits.shape
        S = tg._pick_splits(B * n, logits.shape[-1], 2048, logits.device, 4)
        # torch.empty: a zero fill would add a memset launch to what is timed (the run of 2026-11-30 did that)
        key = torch.empty(B * n * S, dtype=torch.int64, device=logits.device)
        out = torch.empty(B * n + 3 * B + B * (D + 1), dtype=torch.int64, device=logits.device)
        target, accept, best, bonus, path = torch.split(out, (B * n, B, B, B, B * (D + 1)))
        block = triton.next_power_of_2(max(n, D + 1))
        tg._walk_tree[(B,)](key, tokens, parent, depth, target, accept, best, bonus, path, n, S, B * n,
                            D.bit_length(), D, tokens.stride(0), parent.stride(0), depth.stride(0), BLOCK=block,
                            S_TILE=min(triton.next_power_of_2(S), max(1, tg._MERGE_TILE // block)),
                            WITH_PATH=True, PDL=False, KEYS=0, num_warps=warps,
                            **walk_consts(bits_fit(block, D), block, D))  # the walk the library picks
        return out

    return walk


def parse_variant(spec: str) -> dict:
    """'tile=4,pdl=1,walk=jump' -> {'tile': 4, 'pdl': True, 'walk': 'jump'} (0/1 for the bool options, walk and wait a
    name, the rest ints)."""
    kw = {}
    for item in spec.split(","):
        k, _, v = item.partition("=")
        kw[k] = bool(int(v)) if k in ("pdl", "fused", "packed") else v if k in ("walk", "wait") else int(v)
    return kw


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


def rotating_copies(t: torch.Tensor) -> int:
    """How many copies of t the timed graph cycles through: at least 2, and at least 4x the L2 in all, so
    that no call finds its inputs in the L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return max(2, -(-4 * l2 // (t.numel() * t.element_size())))


def gpu_us(fn, inputs: list, replays: int = 20) -> float:
    """Device time per call: one CUDA graph calls fn on each input set in turn, replayed ``replays`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs[:2]:  # warm up (compile, allocator) outside the capture
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # Captured on the warm-up stream: state a kernel keeps per stream (verify's wait="keys" slots) is reused.
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

    read, empty = read_kernel(), empty_kernel()
    bw = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    D = args.depth
    rows = []
    for N in args.nodes:
        for V in args.vocab:
            case = tuple(t.cuda() for t in make_tree(args.batch, N + 1, V, D, gen))
            logits = case[0]
            inputs = [(logits.clone(), *case[1:]) for _ in range(rotating_copies(logits))]
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
            reads = {f"programs={p},block={b},tile={t}": gpu_us(
                lambda lg, *_, p=p, b=b, t=t: read(lg, programs=p, block=b, tile=t), inputs)
                for p in (264, 528, 1056, 2112) for b in (1024, 2048, 4096) for t in (1, 4)}
            row["read_only_best_gpu_us"] = min(reads.values())
            row["read_only_best_grid"] = min(reads, key=reads.get)
            row["empty_kernel_gpu_us"] = gpu_us(lambda lg, *_: empty(lg), inputs)  # one launch, no work
            row["walk_only_gpu_us"] = gpu_us(walk_only(D), inputs)  # the second launch alone, 4 warps
            row["walk_only_1warp_gpu_us"] = gpu_us(walk_only(D, warps=1), inputs)
            for spec in args.variant:
                kw = parse_variant(spec)
                try:
                    row[f"variant[{spec}]_gpu_us"] = gpu_us(lambda *a, kw=kw: triton_fn(*a, **kw), inputs)
                    row[f"variant[{spec}]_exact"] = ok = exact(**kw)
                except Exception as err:  # recorded (and counted as not exact), the other rows still run
                    row[f"variant[{spec}]_gpu_us"], ok = float("nan"), False
                    row[f"variant[{spec}]_exact"] = f"{type(err).__name__}: {str(err)[:300]}"
                row["bit_exact_two_launch"] &= ok
            # Again after hundreds of fused calls and graph replays: right only if every call reset its counters.
            row["bit_exact_fused"] &= exact(fused=True)
            row["bit_exact"] = row["bit_exact_two_launch"] and row["bit_exact_fused"]
            if args.tilings:  # 72 variants, then one graph each
                row["tilings_gpu_us"], row["tilings_not_exact"], row["tilings_failed"] = {}, [], {}
                loops = ({"unroll": 2, "packed": False}, {"packed": True}, {"packed": True, "stages": 3})
                for bv, w, p, loop, pdl, ww in itertools.product((512, 1024, 2048), (4, 8), (2, 4, 8, 16), loops,
                                                                 (True,), (4,)):
                    kw = {"block_v": bv, "num_warps": w, "programs_per_sm": p, **loop, "pdl": pdl, "walk_warps": ww}
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
                  f"reference {row['torch_ref_gpu_us']:.1f} / {row['torch_ref_eager_us']:.1f}, "
                  f"read-only {row['read_only_best_gpu_us']:.1f} ({row['read_only_best_grid']}), "
                  f"empty {row['empty_kernel_gpu_us']:.1f}, walk only {row['walk_only_gpu_us']:.1f} "
                  f"(1 warp {row['walk_only_1warp_gpu_us']:.1f})", file=sys.stderr)
            for spec in args.variant:
                print(f"  variant {spec}: {row[f'variant[{spec}]_gpu_us']:.1f} us gpu, "
                      f"exact {row[f'variant[{spec}]_exact']}", file=sys.stderr)
            if args.tilings:
                best = sorted(row["tilings_gpu_us"].items(), key=lambda kv: kv[1])[:8]
                print("  best tilings: " + "; ".join(f"{k} {v:.1f}" for k, v in best), file=sys.stderr)

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
