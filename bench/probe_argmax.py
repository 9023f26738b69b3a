"""Where the packed argmax loses against a read-only kernel, on an sm_90 GPU (N=64, V=128k by default).

Variants of the verify kernel's first launch, each over the same (row-node, split) grid and slices as
the library's (`triton_greedy._split_grid`), timed alone as bench_verify.py times the kernel (CUDA-graph
replay over rotating inputs, more bytes than the L2 holds):
  library:      `triton_greedy._argmax_partial` (packed loop, order-key epilogue; evict-first loads since
                this probe's run in docs/benchmarks.md, sixth run);
  no epilogue:  the library's loop (`triton_argmax._packed_scan`) with plain loads, then a cheap sum;
  cache=C:      the library's loop and int64 key with the loads' cache modifier C (.cg: L2 only; .cv: none);
  evict_first:  the same with evict-first loads; "same loop, plain loads": with plain loads;
  read-only:    upcast and max over the same slices, no index (bench_verify.py's read-only, on this grid).

    PYTHONPATH=. python bench/probe_argmax.py --out probe_argmax.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from eagle_mm.kernels import triton_greedy as tg
from eagle_mm.kernels.triton_argmax import _packed_key, _packed_scan


@triton.jit
def _scan_variant(logits_ptr, out_ptr, n_nodes, V, chunk, stride_b, stride_n, R, BLOCK_V: tl.constexpr,
                  MODE: tl.constexpr, CACHE: tl.constexpr, EVICT: tl.constexpr):
    # MODE 0: the library's loop, cheap epilogue; 1: the loop with CACHE / EVICT loads, the library's key;
    # 2: read-only (upcast, max).
    r = tl.program_id(0)
    s = tl.program_id(1)
    if MODE == 0:
        cur, pos, lo, hi, offs = _packed_scan(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, 1, 1,
                                              CACHE, EVICT)
        key = tl.sum(tl.sum(cur.to(tl.float32) + pos.to(tl.float32), axis=1), axis=0).to(tl.int64)
    elif MODE == 1:
        cur, pos, lo, hi, offs = _packed_scan(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, 1, 1,
                                              CACHE, EVICT)
        key = _packed_key(cur, pos, lo, hi, offs, BLOCK_V, False)  # the int64 epilogue, as when measured
    else:
        b = r // n_nodes
        node = r % n_nodes
        base = logits_ptr + b.to(tl.int64) * stride_b + node.to(tl.int64) * stride_n
        lo = s * chunk
        hi = tl.minimum(lo + chunk, V)
        offs = tl.arange(0, BLOCK_V)[None, :]
        acc = tl.full((1, BLOCK_V), float("-inf"), tl.float32)
        for start in range(lo, hi, BLOCK_V):
            idx = start + offs
            acc = tl.maximum(acc, tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32))
        key = tl.max(tl.max(acc, axis=1), axis=0).to(tl.int32, bitcast=True).to(tl.int64)
    tl.store(out_ptr + s.to(tl.int64) * R + r, key)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tilings", nargs="+", default=["1024,8,4", "512,4,8", "1024,8,8"], metavar="BV,W,PPS")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_argmax.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "bench")
    from bench_verify import gpu_us, make_tree, rotating_copies

    N, V = args.nodes, args.vocab
    logits = make_tree(1, N + 1, V, 8, torch.Generator().manual_seed(0))[0].cuda()
    inputs = [(logits.clone(),) for _ in range(rotating_copies(logits))]
    n = N + 1
    variants = {"library": None, "no epilogue": (0, "", ""), "cache=.cg": (1, ".cg", ""), "cache=.cv": (1, ".cv", ""),
                "evict_first": (1, "", "evict_first"), "same loop, plain loads": (1, "", ""), "read-only": (2, "", "")}
    rows = {}
    for spec in args.tilings:
        bv, w, pps = (int(x) for x in spec.split(","))
        S, chunk = tg._split_grid(n, V, bv, logits.device, pps)
        row = {}
        for name, v in variants.items():
            def fn(lg, v=v):
                out = torch.empty(S * n, dtype=torch.int64, device=lg.device)
                if v is None:
                    tg._argmax_partial[(n, S)](lg, out, n, V, chunk, lg.stride(0), lg.stride(1), n, BLOCK_V=bv,
                                               UNROLL=1, STAGES=1, TILE=1, PACKED=True, PDL=False,
                                               SHORT=chunk <= 65536, SIGNAL=False, num_warps=w)
                else:
                    _scan_variant[(n, S)](lg, out, n, V, chunk, lg.stride(0), lg.stride(1), n, BLOCK_V=bv, MODE=v[0],
                                          CACHE=v[1], EVICT=v[2], num_warps=w)
                return out
            try:
                row[name] = gpu_us(fn, inputs)
            except Exception as err:  # recorded, the other variants still run
                row[name] = f"{type(err).__name__}: {str(err)[:160]}"
        rows[spec] = row
        print(f"{spec}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "N": N, "V": V, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
