"""Would TMA loads make the greedy verify kernel's argmax faster? An sm_90 probe, not library code.

The library's argmax (`triton_greedy._argmax_partial`) loads each program's slice with plain vector loads,
a few in flight per thread. Here the same packed-pair argmax reads through a TMA tensor descriptor over
the logits seen as (B*(N+1)*V/256, 256) rows (V a multiple of 256), (TILE_R, 256) boxes per load, and
Triton's software pipelining keeps STAGES loads in flight per program. Timed alone (argmax launch only)
and with the library's walk after it, as bench_verify.py times the kernel; keys checked against torch.

    PYTHONPATH=. python bench/probe_tma.py --out probe_tma.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from eagle_mm.kernels.triton_argmax import _order_key, _pair_update

W = 256  # a TMA box is at most 256 elements wide
_W = tl.constexpr(W)


@triton.jit
def _argmax_tma(desc, key_ptr, rows_per_node, rows_per_split, R, TILE_R: tl.constexpr, STAGES: tl.constexpr):
    # grid (R, S): program (node r, split s) reads rows [s*rows_per_split, ...) of node r's rows_per_node rows.
    r = tl.program_id(0)
    s = tl.program_id(1)
    lo = s * rows_per_split
    hi = tl.minimum(lo + rows_per_split, rows_per_node)
    base = r * rows_per_node
    n_it = tl.cdiv(hi - lo, TILE_R)
    offs = tl.arange(0, TILE_R)[:, None] * _W + tl.arange(0, _W)[None, :]  # (TILE_R, W) element offsets
    cur = tl.full((TILE_R, _W), float("-inf"), tl.bfloat16)
    pos = tl.zeros((TILE_R, _W), tl.int16)
    for it in tl.range(0, n_it, num_stages=STAGES):
        val = desc.load([base + lo + it * TILE_R, 0])
        # Rows past the split belong to the next node (or past the tensor: TMA fills 0): never the max.
        val = tl.where((lo + it * TILE_R + tl.arange(0, TILE_R))[:, None] < hi, val, float("-inf"))
        cur, pos = _pair_update(val, cur, pos, it.to(tl.int16))
    idx = lo * _W + pos.to(tl.int32) * (TILE_R * _W) + offs
    key = tl.max(tl.max(tl.where(idx < hi * _W, _order_key(cur.to(tl.float32), idx), -9223372036854775807), axis=1),
                 axis=0)
    tl.store(key_ptr + s.to(tl.int64) * R + r, key)


def tma_argmax(logits, tile_r: int, stages: int, warps: int, pps: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from eagle_mm.kernels import triton_greedy as tg

    B, n, V = logits.shape
    R, rows = B * n, V // W
    S = tg._pick_splits(R, V, W * tile_r, logits.device, pps)
    per_split = triton.cdiv(triton.cdiv(rows, S), tile_r) * tile_r
    S = triton.cdiv(rows, per_split)
    desc = TensorDescriptor.from_tensor(logits.view(R * rows, W), block_shape=[tile_r, W])
    keys = torch.empty(S * R, dtype=torch.int64, device=logits.device)
    _argmax_tma[(R, S)](desc, keys, rows, per_split, R, TILE_R=tile_r, STAGES=stages, num_warps=warps)
    return keys.view(S, R)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("probe_tma.py needs an sm_90 GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "bench")
    from bench_verify import copy_bandwidth, gpu_us, make_tree, rotating_copies

    N, V = args.nodes, args.vocab
    if V % W:
        raise ValueError(f"--vocab must be a multiple of {W}, got {V}")
    case = tuple(t.cuda() for t in make_tree(1, N + 1, V, 8, torch.Generator().manual_seed(0)))
    inputs = [(case[0].clone(),) for _ in range(rotating_copies(case[0]))]
    want = case[0][0].argmax(-1)
    floor = case[0].numel() * 2 / copy_bandwidth() * 1e6
    res = {}
    for tile_r, stages, warps, pps in itertools.product((2, 4, 8), (4, 6, 8), (4, 8), (2, 4, 8)):
        name = f"tile_r={tile_r},stages={stages},num_warps={warps},programs_per_sm={pps}"
        try:
            keys = tma_argmax(case[0], tile_r, stages, warps, pps)
            got = 2147483647 - (keys.max(0).values & 2147483647)
            exact = bool(torch.equal(got, want))
            res[name] = {"us": gpu_us(lambda lg, a=(tile_r, stages, warps, pps): tma_argmax(lg, *a), inputs),
                         "exact": exact}
        except Exception as err:  # recorded, the others still run
            res[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    timed = sorted(((k, v["us"]) for k, v in res.items() if "us" in v), key=lambda kv: kv[1])
    print(f"N={N} V={V} floor {floor:.2f} us; TMA argmax alone, best: "
          + "; ".join(f"{k} {v:.2f} (exact {res[k]['exact']})" for k, v in timed[:10]), file=sys.stderr)
    errors = [k for k, v in res.items() if "error" in v]
    if errors:
        print(f"{len(errors)} failed, e.g. {errors[0]}: {res[errors[0]]['error']}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "N": N, "V": V, "floor_us": floor, "argmax": res},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
