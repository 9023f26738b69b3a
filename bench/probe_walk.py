"""Where the greedy verify kernel spends its time, on a CUDA GPU: the walk's stages, the argmax's tilings.

`eagle_mm.kernels.triton_walk._walk_jump`'s stages (its own helpers) with `%clock64` read after each stage (each reading
depends on the stage's result, so it cannot move ahead of it). It runs one program per call over keys of
an earlier argmax, many times; prints the median cycles per stage and in ns at the SM clock.
--argmax-sweep also times the argmax launch alone (no walk) over block_v x warps x programs per SM, packed
and exact, against a read-only kernel; --sass BV,W,PPS,PACKED writes one argmax tiling's PTX and SASS.

    PYTHONPATH=. python bench/probe_walk.py --nodes 16 64 128 --argmax-sweep --sass 1024,4,8,1 --out probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from eagle_mm.kernels.triton_greedy import _MERGE_TILE
from eagle_mm.kernels.triton_walk import _accepted, _deepest, _merged_target, _path

STAGES = ("tree loads", "key merge", "ok (gather)", "pointer jumping", "best (max)", "bonus (sum)", "path loop",
          "stores")


@triton.jit
def _clock(dep):
    # dep: int32, scalar or per lane: each reading waits for its own element.
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _walk_probe(part_key_ptr, tokens_ptr, parent_ptr, depth_ptr, target_ptr, out_ptr, clock_ptr,
                n_nodes, S, R, lift_rounds, max_depth,
                BLOCK: tl.constexpr, S_TILE: tl.constexpr):
    # The library walk's stages (its own helpers), row 0, with a clock reading after each.
    t0 = _clock(tl.program_id(0))
    i = tl.arange(0, BLOCK)
    live = i < n_nodes
    tokens = tl.load(tokens_ptr + i, mask=live, other=-1).to(tl.int64)
    tokens = tl.where((tokens >= 0) & (tokens < 2147483648), tokens, -1).to(tl.int32)
    parent = tl.load(parent_ptr + i, mask=live, other=0).to(tl.int32)
    depth = tl.load(depth_ptr + i, mask=live, other=0).to(tl.int32)
    t1 = _clock(tokens + parent + depth)  # per lane: no extra reduction in the measured path
    rows = i.to(tl.int64)
    target = _merged_target(part_key_ptr, rows, live, S, R, BLOCK, S_TILE, False)
    t2 = _clock(target.to(tl.int32))
    target32 = target.to(tl.int32)
    ok = ((tokens == tl.gather(target32, parent, 0)) | (i == 0)) & live
    t3 = _clock(ok.to(tl.int32))
    flag = _accepted(ok, parent, lift_rounds)
    t4 = _clock(flag)
    best, accept = _deepest(flag, live, depth, i)
    t5 = _clock(best)
    bonus = tl.sum(tl.where(i == best, target32, 0), axis=0).to(tl.int64)
    t6 = _clock(bonus.to(tl.int32))
    node = _path(parent, best, accept, i, max_depth, BLOCK)
    t7 = _clock(node)
    tl.store(target_ptr + rows, target, mask=live)
    tl.store(out_ptr, accept.to(tl.int64))
    tl.store(out_ptr + 1, best.to(tl.int64))
    tl.store(out_ptr + 2, bonus)
    tl.store(out_ptr + 3 + i, node.to(tl.int64), mask=i <= max_depth)
    t8 = _clock(node + i)
    stamps = tl.arange(0, 16)
    t = tl.where(stamps == 0, t0, 0)
    t = tl.where(stamps == 1, tl.max(t1, axis=0), t)  # a stage ends when its last lane is done
    t = tl.where(stamps == 2, tl.max(t2, axis=0), t)
    t = tl.where(stamps == 3, tl.max(t3, axis=0), t)
    t = tl.where(stamps == 4, tl.max(t4, axis=0), t)
    t = tl.where(stamps == 5, t5, t)
    t = tl.where(stamps == 6, t6, t)
    t = tl.where(stamps == 7, tl.max(t7, axis=0), t)
    t = tl.where(stamps == 8, tl.max(t8, axis=0), t)
    tl.store(clock_ptr + stamps, t, mask=stamps <= 8)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--splits", type=int, default=9)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--warps", type=int, nargs="+", default=[1, 4])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--argmax-sweep", action="store_true", help="also time the argmax launch alone over tilings")
    p.add_argument("--packed-only", action="store_true", help="the sweep leaves out the exact loop")
    p.add_argument("--sass", action="append", default=[], metavar="BV,W,PPS,PACKED",
                   help="write this argmax tiling's PTX and SASS next to --out, e.g. 1024,4,8,1 (repeatable)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_walk.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "bench")
    from bench_verify import random_tree

    ghz = torch.cuda.get_device_properties(0).clock_rate / 1e6 if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1.98
    gen = torch.Generator().manual_seed(0)
    rows = []
    for N in args.nodes:
        n, D, S = N + 1, args.depth, args.splits
        parent, depth = (t[0].cuda() for t in random_tree(1, n, D, gen))
        tokens = torch.randint(0, 1000, (n,), device="cuda")
        key = torch.randint(0, 2**40, (S * n,), device="cuda")
        target = torch.empty(n, dtype=torch.int64, device="cuda")
        out = torch.empty(3 + D + 1, dtype=torch.int64, device="cuda")
        block = triton.next_power_of_2(max(n, D + 1))
        s_tile = min(triton.next_power_of_2(S), max(1, _MERGE_TILE // block))
        for w in args.warps:
            clocks = torch.empty(args.calls, 16, dtype=torch.int64, device="cuda")
            for c in range(args.calls):
                _walk_probe[(1,)](key, tokens, parent, depth, target, out, clocks[c], n, S, n, D.bit_length(), D,
                                  BLOCK=block, S_TILE=s_tile, num_warps=w)
            torch.cuda.synchronize()
            d = (clocks[20:, 1:9] - clocks[20:, 0:8]).double().median(0).values  # skip the first calls
            total = (clocks[20:, 8] - clocks[20:, 0]).double().median().item()
            row = {"N": N, "nodes": n, "warps": w, "splits": S, "depth": D, "sm_ghz": ghz,
                   "stage_cycles": dict(zip(STAGES, d.tolist())), "total_cycles": total,
                   "total_ns": total / ghz}
            rows.append(row)
            print(f"N={N} warps={w}: total {total:.0f} cycles = {total / ghz:.0f} ns; "
                  + ", ".join(f"{k} {v:.0f}" for k, v in row["stage_cycles"].items()), file=sys.stderr)
    for spec in args.sass:  # the compiled code of one argmax tiling, to read why it runs as it does
        dump_code(spec, os.path.dirname(os.path.abspath(args.out)) if args.out else ".")
    sweep = argmax_sweep(loops=(True,) if args.packed_only else (True, False)) if args.argmax_sweep else None
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows, "argmax_sweep": sweep}, f, indent=1)
    return 0



def _argmax_launch(logits, block_v, warps, pps, packed, tile=1):
    """The verify kernel's first launch alone (argmax keys, no walk); returns Triton's compiled kernel."""
    from eagle_mm.kernels import triton_greedy as tg
    from eagle_mm.kernels.triton_argmax import short_key

    B, n, V = logits.shape
    S, chunk = tg._split_grid(B * n, V, block_v, logits.device, pps)  # at most pps programs per SM
    keys = torch.empty(S * B * n, dtype=torch.int64, device=logits.device)
    return tg._argmax_partial[(B * n, S)](logits, keys, n, V, chunk, logits.stride(0), logits.stride(1), B * n,
                                          BLOCK_V=block_v, UNROLL=1, STAGES=1, TILE=tile, PACKED=packed, PDL=False,
                                          SHORT=short_key(packed, chunk), SIGNAL=False, num_warps=warps)


def dump_code(spec: str, out_dir: str, N: int = 64, V: int = 128256) -> None:
    """spec 'block_v,num_warps,programs_per_sm,packed' (packed 0/1): write that argmax tiling's PTX and SASS."""
    bv, w, pps, pk = (int(x) for x in spec.split(","))
    logits = torch.randn(1, N + 1, V, device="cuda").to(torch.bfloat16)
    kernel = _argmax_launch(logits, bv, w, pps, bool(pk))
    for kind in ("ptx", "sass"):
        try:
            text = kernel.asm[kind]
        except Exception as err:  # SASS needs the nvdisasm that Triton ships; say so if it is missing
            text = f"no {kind}: {type(err).__name__}: {err}"
        with open(os.path.join(out_dir, f"argmax_{bv}_{w}_{pps}_{pk}.{kind}"), "w") as f:
            f.write(str(text))


def argmax_sweep(N: int = 64, V: int = 128256, top: int = 8, loops=(True, False)) -> dict:
    """The two-launch kernel's first launch alone (argmax keys, no walk), over programs/SM x block_v x warps x
    loop (and chunks per load, tile, for the packed one), timed as bench_verify times the whole kernel
    (CUDA-graph replay over rotating inputs); then the whole kernel at the ``top`` best argmax tilings.
    ``loops``: packed (True) and / or exact (False)."""
    import itertools

    from bench_verify import copy_bandwidth, gpu_us, make_tree, rotating_copies

    case = tuple(t.cuda() for t in make_tree(1, N + 1, V, 8, torch.Generator().manual_seed(0)))
    inputs = [(case[0].clone(),) for _ in range(rotating_copies(case[0]))]

    res, kws = {}, {}
    for bv, w, pps, pk, tile in itertools.product((256, 512, 1024, 2048), (2, 4, 8), (4, 8, 16), loops, (1, 2, 4)):
        if bv // (32 * w) < 2 or bv // (32 * w) > 16 or (tile > 1 and (not pk or bv // (32 * w) > 8)):
            continue  # 2..16 elements per thread per load; several loads per step (tile) for the packed loop
        name = (f"block_v={bv},num_warps={w},programs_per_sm={pps},packed={pk},tile={tile},"
                f"per_thread={bv // (32 * w)}")
        kws[name] = {"block_v": bv, "num_warps": w, "programs_per_sm": pps, "packed": pk, "tile": tile}
        try:
            res[name] = gpu_us(lambda lg, a=(bv, w, pps, pk, tile): _argmax_launch(lg, *a), inputs)
        except Exception as err:  # a tiling that cannot compile or run is recorded
            res[name] = f"{type(err).__name__}: {str(err)[:120]}"
    from bench_verify import read_kernel
    read = read_kernel()
    reads = {f"programs={p},block={b}": gpu_us(lambda lg, p=p, b=b: read(lg, programs=p, block=b), inputs)
             for p in (1056, 2112, 4224, 8448) for b in (512, 1024, 2048)}
    print("read only: " + "; ".join(f"{k} {v:.2f}" for k, v in sorted(reads.items(), key=lambda kv: kv[1])[:6]),
          file=sys.stderr)
    floor = case[0].numel() * 2 / copy_bandwidth() * 1e6
    timed = {k: v for k, v in res.items() if isinstance(v, float)}
    best = sorted(timed.items(), key=lambda kv: kv[1])[:10]
    print(f"argmax only, N={N} V={V}, floor {floor:.2f} us: " + "; ".join(f"{k} {v:.2f}" for k, v in best),
          file=sys.stderr)
    # The whole kernel (argmax, then the walk launched early) at the argmax's best tilings, bit-exact checked.
    from eagle_mm.kernels.reference import verify_greedy_reference
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton

    full_inputs = [(lg, *case[1:]) for (lg,) in inputs]
    want = verify_greedy_reference(*case, 8, with_path=True)
    full = {}
    for name, _ in best[:top]:
        kw = kws[name]
        full[name] = gpu_us(lambda *a, kw=kw: verify_greedy_triton(*a, 8, with_path=True, **kw), full_inputs)
        got = verify_greedy_triton(*case, 8, with_path=True, **kw)
        full[name + ",exact"] = all(torch.equal(g, w) for g, w in zip(got, want))
    print("whole kernel: " + "; ".join(f"{k} {v:.2f}" for k, v in full.items() if isinstance(v, float)),
          file=sys.stderr)
    return {"N": N, "V": V, "floor_us": floor, "argmax_only_gpu_us": res, "read_only_gpu_us": reads,
            "whole_kernel_gpu_us": full}


if __name__ == "__main__":
    sys.exit(main())
