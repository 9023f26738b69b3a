"""When each part of the greedy verify kernel runs, on an sm_90 GPU: %globaltimer stamps in every argmax
program and in the walk, one call at a time, after the L2 is flushed.

Each call is one CUDA graph: a 256 MiB memset (flushes the L2), the library's packed argmax launch, then a
walk launched early (programmatic dependent launch), as `verify_greedy_triton` runs them. The argmax
programs (`triton_argmax._packed_scan` + `_packed_key`) stamp their start, the end of their loop and the
end of their key; the walk stamps its start, the tree's loads, its tables, the alu probe's dry pass, the
end of gdc_wait and its end (bits walk: `triton_walk._tree_tables` + `_bits_after_keys`; jump walk: its
helpers; alu:
only arithmetic after the wait, to see what running cold code costs there).
Prints, per variant, the median over calls of each stamp in ns after the first argmax program started.

    PYTHONPATH=. python bench/probe_timeline.py --out timeline.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from eagle_mm.kernels import triton_greedy as tg
from eagle_mm.kernels.triton_argmax import _packed_key, _packed_scan, short_key
from eagle_mm.kernels.triton_walk import (_accepted, _bits_after_keys, _deepest, _merged_target, _path, _tree_tables,
                                          walk_consts)


@triton.jit
def _now(dep):
    # %globaltimer (ns), read after dep (int32, scalar or per lane) is ready.
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _smid(dep):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _argmax_timed(logits_ptr, part_key_ptr, stamp_ptr, n_nodes, V, chunk, stride_b, stride_n, R,
                  BLOCK_V: tl.constexpr, SHORT: tl.constexpr):
    gdc_launch_dependents()
    r = tl.program_id(0)
    s = tl.program_id(1)
    t0 = _now(r)
    cur, pos, lo, hi, offs = _packed_scan(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, 1, 1, "",
                                          "")  # plain loads, as when measured
    t1 = _now(pos.to(tl.int32))  # per slot: each waits for its own loop result
    key = _packed_key(cur, pos, lo, hi, offs, BLOCK_V, SHORT)
    tl.store(part_key_ptr + s.to(tl.int64) * R + r, key)
    t2 = _now(key.to(tl.int32))
    pid = s * R + r
    tl.store(stamp_ptr + 4 * pid, t0)
    tl.store(stamp_ptr + 4 * pid + 1, tl.max(tl.max(t1, axis=1), axis=0))
    tl.store(stamp_ptr + 4 * pid + 2, t2)
    tl.store(stamp_ptr + 4 * pid + 3, _smid(r).to(tl.int64))


@triton.jit
def _walk_timed(part_key_ptr, tokens_ptr, parent_ptr, depth_ptr, target_ptr, out_ptr, path_ptr, stamp_ptr,
                n_nodes, S, R, max_depth, lift_rounds, passes, BLOCK: tl.constexpr, S_TILE: tl.constexpr,
                BITS: tl.constexpr, ALU: tl.constexpr, W: tl.constexpr, PW: tl.constexpr):
    t0 = _now(tl.program_id(0))
    i = tl.arange(0, BLOCK)
    live = i < n_nodes
    tokens = tl.load(tokens_ptr + i, mask=live, other=-1).to(tl.int32)
    parent = tl.load(parent_ptr + i, mask=live, other=0).to(tl.int32)
    depth = tl.load(depth_ptr + i, mask=live, other=0).to(tl.int32)
    t1 = tl.max(_now(tokens + parent + depth), axis=0)
    t2 = t1
    t3 = t1
    if BITS:
        anc0, anc1, anc2, anc3, path0, path1 = _tree_tables(parent, depth, i, max_depth, W, PW)
        t2 = tl.max(_now((anc0 + path0).to(tl.int32)), axis=0)
        t3 = t2
        gdc_wait()
        t4 = _now(tl.program_id(0))
        top = _bits_after_keys(tl.program_id(0), part_key_ptr, tokens, parent, depth, i, live, anc0, anc1, anc2,
                               anc3, path0, path1, target_ptr, out_ptr, out_ptr + 1, out_ptr + 2, path_ptr, n_nodes,
                               S, R, max_depth, BLOCK, S_TILE, W, PW, True, False)
        t5 = _now(top.to(tl.int32))
    elif ALU:
        # No memory after the wait: 4 independent chains of 64 multiply-xorshift steps (~768 instructions,
        # ~12 KB of code). With passes = 2 the same code (a runtime loop: one copy) runs once before the wait.
        x0 = i.to(tl.uint32)
        x1, x2, x3 = x0 + 1, x0 + 2, x0 + 3
        t4 = t1
        for p in range(0, passes):
            if p == passes - 1:
                gdc_wait()
            t4 = tl.max(_now(x0.to(tl.int32)), axis=0)
            for k in tl.static_range(64):
                x0 = (x0 * 1664525) ^ (x0 >> 13) ^ k
                x1 = (x1 * 22695477) ^ (x1 >> 11) ^ k
                x2 = (x2 * 69069) ^ (x2 >> 7) ^ k
                x3 = (x3 * 1103515245) ^ (x3 >> 17) ^ k
        x = x0 ^ x1 ^ x2 ^ x3
        t5 = tl.max(_now(x.to(tl.int32)), axis=0)
        tl.store(path_ptr + i, x.to(tl.int64), mask=i <= max_depth)
    else:
        gdc_wait()
        t4 = _now(tl.program_id(0))
        target = _merged_target(part_key_ptr, i.to(tl.int64), live, S, R, BLOCK, S_TILE, False)
        tl.store(target_ptr + i, target, mask=live)
        target = target.to(tl.int32)
        ok = ((tokens == tl.gather(target, parent, 0)) | (i == 0)) & live
        best, accept = _deepest(_accepted(ok, parent, lift_rounds), live, depth, i)
        node = _path(parent, best, accept, i, max_depth, BLOCK)
        tl.store(path_ptr + i, node.to(tl.int64), mask=i <= max_depth)
        tl.store(out_ptr, accept.to(tl.int64))
        t5 = tl.max(_now(node), axis=0)
    stamps = tl.arange(0, 8)
    t = tl.where(stamps == 0, t0, 0)
    t = tl.where(stamps == 1, t1, t)
    t = tl.where(stamps == 2, t2, t)
    t = tl.where(stamps == 3, t3, t)
    t = tl.where(stamps == 4, t4, t)
    t = tl.where(stamps == 5, t5, t)
    tl.store(stamp_ptr + stamps, t, mask=stamps < 6)


WALK_STAMPS = ("walk start", "tree loaded", "tables built", "dry pass done", "gdc_wait returned", "walk done")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tilings", nargs="+", default=["1024,8,4", "512,4,8"], metavar="BV,W,PPS")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--walks", nargs="+", default=["none", "jump", "bits", "alu", "alu+dry"],
                   help="none: the argmax alone; jump, bits: the library's walks; alu: ~768 arithmetic "
                        "instructions after the wait; alu+dry: the same code once before the wait too")
    p.add_argument("--raw", action="store_true", help="keep every program's stamps and SM in --out")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_timeline.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "bench")
    from bench_verify import make_tree

    N, V, D = args.nodes, args.vocab, 8
    logits, tokens, parent, depth = (t.cuda() for t in make_tree(1, N + 1, V, D, torch.Generator().manual_seed(0)))
    n = N + 1
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    block = triton.next_power_of_2(max(n, D + 1))
    results = {}
    for spec in args.tilings:
        bv, w, pps = (int(x) for x in spec.split(","))
        S, chunk = tg._split_grid(n, V, bv, logits.device, pps)
        for walk in args.walks:
            keys = torch.empty(S * n, dtype=torch.int64, device="cuda")
            target = torch.empty(n, dtype=torch.int64, device="cuda")
            out = torch.empty(8, dtype=torch.int64, device="cuda")
            path = torch.empty(D + 1, dtype=torch.int64, device="cuda")
            a_st = torch.zeros(S * n, 4, dtype=torch.int64, device="cuda")  # start, loop end, key stored, SM
            w_st = torch.zeros(8, dtype=torch.int64, device="cuda")

            def call():
                flush.zero_()
                _argmax_timed[(n, S)](logits, keys, a_st, n, V, chunk, logits.stride(0), logits.stride(1), n,
                                      BLOCK_V=bv, SHORT=short_key(True, chunk), num_warps=max(1, min(w, bv // 64)))
                if walk != "none":
                    bits, alu = walk == "bits", walk.startswith("alu")
                    _walk_timed[(1,)](keys, tokens, parent, depth, target, out, path, w_st, n, S, n, D, D.bit_length(),
                                      2 if walk.endswith("+dry") else 1, BLOCK=block, ALU=alu,
                                      S_TILE=min(triton.next_power_of_2(S), max(1, 8192 // block)),
                                      **walk_consts(bits, block, D), num_warps=4,
                                      launch_pdl=True)

            call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            rows, raw = [], []
            for _ in range(args.calls):
                graph.replay()
                torch.cuda.synchronize()
                a = a_st.cpu()
                t_zero = a[:, 0].min().item()
                if args.raw:  # per program (s * R + r): start, loop end, key stored (ns after t_zero), SM
                    raw.append(torch.cat([a[:, :3] - t_zero, a[:, 3:]], 1).tolist())
                row = {"argmax last start": a[:, 0].max().item() - t_zero,
                       "argmax loop end (median program)": a[:, 1].median().item() - t_zero,
                       "argmax loop end (last program)": a[:, 1].max().item() - t_zero,
                       "argmax key (median program, after its loop)": (a[:, 2] - a[:, 1]).median().item(),
                       "argmax key (longest, after its loop)": (a[:, 2] - a[:, 1]).max().item(),
                       "argmax last key stored": a[:, 2].max().item() - t_zero}
                if walk != "none":
                    ws = w_st.cpu().tolist()
                    row.update({name: ws[k] - t_zero for k, name in enumerate(WALK_STAMPS)})
                rows.append(row)
            med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
            ticks = sorted({v for r in rows for v in r.values()})
            med["timer_step_ns"] = min((b - a for a, b in zip(ticks, ticks[1:]) if b > a), default=None)
            print(f"{spec} {walk}: " + ", ".join(f"{k} {v}" for k, v in med.items()), file=sys.stderr)
            results[f"{spec},{walk}"] = dict(med, raw_programs=raw) if args.raw else med
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "N": N, "V": V, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
