"""What the greedy verify kernel's second launch costs after its argmax, on an sm_90 GPU with pdl.

The library's argmax launch (`triton_greedy._argmax_partial`, pdl on) followed by tails of growing work,
each launched early (programmatic dependent launch) like the library's walk:
  none:          the argmax alone (no second launch);
  null:          gdc_wait, then one store: the least any second launch adds;
  merge:         gdc_wait, the walk's merge of the splits' keys (one per split and node), the targets stored;
  atomic merge:  the argmax merges the splits itself (an atomic max per node), the tail reads one key per
                 node, stores the targets and empties the keys;
  walk:          the whole library kernel (`verify_greedy_triton`) at that tiling.
Per tiling (block_v, warps, programs per SM) of the packed argmax; also each argmax tiling's registers and
spills. Times as bench_verify.py times the kernel (CUDA-graph replay over rotating inputs).

    PYTHONPATH=. python bench/probe_pdl.py --out probe_pdl.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from eagle_mm.kernels.triton_argmax import _slice_key_any, short_key
from eagle_mm.kernels.triton_walk import _merged_target

EMPTY = -9223372036854775807


@triton.jit
def _argmax_atomic(logits_ptr, key_ptr, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V: tl.constexpr,
                   SHORT: tl.constexpr):
    # The library's packed argmax program, merging its key into key_ptr[r] by an atomic max.
    gdc_launch_dependents()
    r = tl.program_id(0)
    key = _slice_key_any(logits_ptr, r, tl.program_id(1), n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, 1, 1, 1,
                         True, SHORT)
    tl.atomic_max(key_ptr + r, key, sem="relaxed")


@triton.jit
def _tail(key_ptr, target_ptr, n, S, R, MODE: tl.constexpr, BLOCK: tl.constexpr, S_TILE: tl.constexpr):
    i = tl.arange(0, BLOCK)
    live = i < n
    gdc_wait()
    if MODE == 0:  # null
        tl.store(target_ptr, 1)
    elif MODE == 1:  # merge the splits, as the library's walk does
        target = _merged_target(key_ptr, i.to(tl.int64), live, S, R, BLOCK, S_TILE, False)
        tl.store(target_ptr + i, target, mask=live)
    else:  # keys merged by the argmax: read one per node, empty them
        key = tl.load(key_ptr + i, mask=live, other=-9223372036854775807)
        tl.store(key_ptr + i, tl.full((BLOCK,), -9223372036854775807, tl.int64), mask=live)
        tl.store(target_ptr + i, 2147483647 - (key & 2147483647), mask=live)


def pipeline(mode: str, block_v: int, warps: int, pps: int, keys_store: dict):
    from eagle_mm.kernels import triton_greedy as tg

    def run(logits, *_):
        B, n, V = logits.shape
        R = B * n
        S, chunk = tg._split_grid(R, V, block_v, logits.device, pps)
        atomic = mode == "atomic merge"
        if atomic:
            if "keys" not in keys_store:
                keys_store["keys"] = torch.full((R,), EMPTY, dtype=torch.int64, device=logits.device)
            keys = keys_store["keys"]
        else:
            keys = torch.empty(S * R, dtype=torch.int64, device=logits.device)
        target = torch.empty(R, dtype=torch.int64, device=logits.device)
        w = max(1, min(warps, block_v // 64))
        if atomic:
            _argmax_atomic[(R, S)](logits, keys, n, V, chunk, logits.stride(0), logits.stride(1), BLOCK_V=block_v,
                                   SHORT=short_key(True, chunk), num_warps=w)
        else:
            keys_store["kernel"] = tg._argmax_partial[(R, S)](
                logits, keys, n, V, chunk, logits.stride(0), logits.stride(1), R, BLOCK_V=block_v, UNROLL=1,
                STAGES=1, TILE=1, PACKED=True, PDL=mode != "none",
                SHORT=short_key(True, chunk), SIGNAL=False, num_warps=w)
        if mode != "none":
            block = triton.next_power_of_2(n)
            _tail[(1,)](keys, target, n, S, R, MODE={"null": 0, "merge": 1, "atomic merge": 2}[mode], BLOCK=block,
                        S_TILE=min(triton.next_power_of_2(S), max(1, 8192 // block)), num_warps=4,
                        launch_pdl=True)
        return target

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tilings", nargs="+", default=["1024,8,4", "512,4,8", "512,4,16", "256,2,8", "256,2,16",
                                                     "256,4,8", "512,8,8", "2048,8,4", "1024,4,8"], metavar="BV,W,PPS")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pdl.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "bench")
    from bench_verify import copy_bandwidth, gpu_us, make_tree, rotating_copies

    from eagle_mm.kernels.reference import verify_greedy_reference
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton

    N, V, D = args.nodes, args.vocab, 8
    case = tuple(t.cuda() for t in make_tree(1, N + 1, V, D, torch.Generator().manual_seed(0)))
    inputs = [(case[0].clone(), *case[1:]) for _ in range(rotating_copies(case[0]))]
    floor = case[0].numel() * 2 / copy_bandwidth() * 1e6
    want = verify_greedy_reference(*case, D, with_path=True)
    rows = {}
    for spec in args.tilings:
        bv, w, pps = (int(x) for x in spec.split(","))
        row, store = {}, {}
        for mode in ("none", "null", "merge", "atomic merge"):
            fn = pipeline(mode, bv, w, pps, store)
            row[mode] = gpu_us(fn, inputs)
            if mode == "none":
                k = store["kernel"]
                row["regs"], row["spills"] = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
            if mode == "atomic merge":  # the merged keys are the reference's argmax
                got = fn(*case)
                row["atomic_merge_exact"] = bool(torch.equal(got, want[4].flatten()))
        kw = {"block_v": bv, "num_warps": w, "programs_per_sm": pps}
        row["walk"] = gpu_us(lambda *a: verify_greedy_triton(*a, D, with_path=True, **kw), inputs)
        got = verify_greedy_triton(*case, D, with_path=True, **kw)
        row["walk_exact"] = all(torch.equal(g, x) for g, x in zip(got, want))
        rows[spec] = row
        print(f"{spec}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              file=sys.stderr)
    print(f"N={N} V={V} floor {floor:.2f} us", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "N": N, "V": V, "floor_us": floor,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
