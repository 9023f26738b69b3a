"""The H100 fault of dev/notes/crash-sampled64.md in one fresh process: code-tiny at ``--batch`` rows, HF's
compiled ``generate`` (static cache: inductor's CUDA graph trees) once, then the default call once, as bench_matrix's
first calls of a row run them. ``--variant``:

- ``static_then_ours``: as the matrix does (ab19 and ab20 faulted here at batch 64);
- ``ours_only``: no HF static before ours;
- ``static_sync_empty``: after HF static, synchronize, collect and empty the allocator's cache, then ours;
- ``static_reset_trees``: after HF static, inductor's CUDA graph trees reset, then ours;
- ``ours_then_static_then_ours``: ours first (its graphs captured before any tree), HF static, ours again.

Prints one line: the variant, the batch, and "ok" with the seconds of each call, or the error. A fault kills the
process (its exit code says so).

    PYTHONPATH=. python dev/gpu/fault_repro.py --batch 64 --variant static_then_ours
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import eagle_mm  # noqa: E402
from eagle_mm import zoo  # noqa: E402

VARIANTS = ("static_then_ours", "ours_only", "static_sync_empty", "static_reset_trees", "ours_then_static_then_ours")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--variant", choices=VARIANTS, default="static_then_ours")
    p.add_argument("--mode", choices=("greedy", "sampled"), default="greedy")
    args = p.parse_args()
    m = zoo.load("code-tiny", device=torch.device("cuda"))
    tok = m.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts = (m.prompts * (args.batch // len(m.prompts) + 1))[: args.batch]
    enc = dict(tok(prompts, return_tensors="pt", padding=True).to("cuda"))
    sample = dict(do_sample=True, temperature=0.8, top_p=0.95) if args.mode == "sampled" else dict(do_sample=False)
    common = dict(**enc, max_new_tokens=128, min_new_tokens=128, **sample)
    seconds = []

    def run(name, fn):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(f"{name} {time.perf_counter() - t:.2f}s")

    static = lambda: m.target.generate(**common, cache_implementation="static")  # noqa: E731
    ours = lambda: eagle_mm.speculative_generate(m.target, m.eagle3_head, **common,  # noqa: E731
                                                 generator=torch.Generator("cuda").manual_seed(0))
    if args.variant == "ours_then_static_then_ours":
        run("ours", ours)
    if args.variant != "ours_only":
        run("static", static)
    if args.variant == "static_sync_empty":
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
    if args.variant == "static_reset_trees":
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    run("ours", ours)
    run("ours again", ours)
    print(f"{args.variant} batch {args.batch} {args.mode}: ok ({', '.join(seconds)})", flush=True)


if __name__ == "__main__":
    main()
