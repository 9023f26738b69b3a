"""Benchmark greedy tree verification (`eagle_mm.kernels.verify_greedy`'s Triton kernel) on a CUDA GPU.

For each tree size N and vocabulary V (bf16 logits (B, N+1, V), a random tree of depth <= D with one planted
accepted path) it times, with bench/harness.py:
  triton     the kernel: its first call alone (compilation), then CUDA-graph replay over rotating copies of
             the inputs (more bytes than the L2 holds: device time, no launch overhead), and wall clock per call;
  torch_ref  the pure-torch reference (argmax + greedy_accept + path_indices), the same two ways;
  compare    with --compare MODULE, another module's verify_greedy_triton (an A/B against an older kernel);
  floor      the bytes of logits read once over the device's measured copy bandwidth.
Every Triton result is checked bit-exact against the reference; the exit status is 1 if any differs, 2
without CUDA. Prints a markdown table; --record appends the rows to bench/results.jsonl. Run from the
repository root:

    PYTHONPATH=. python bench/bench_verify.py --nodes 64 --vocab 128256 --record
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_record_arg, copy_bandwidth, gpu_us, record, rotating_copies, timed_call, wall_s  # noqa: E402


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The logits shapes swept by both verify benchmarks (this one and bench_verify_sampling.py)."""
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 128], help="draft nodes N (the tree has N+1)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 152064])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--depth", type=int, default=8, help="max tree depth D")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--compare", metavar="MODULE",
                   help="also time MODULE.verify_greedy_triton (importable dotted name), e.g. an older kernel")
    add_record_arg(p)
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


def time_shape(args, N: int, V: int, bw: float, gen: torch.Generator, methods: dict) -> dict:
    from eagle_mm.kernels.reference import verify_greedy_reference

    D = args.depth
    case = tuple(t.cuda() for t in make_tree(args.batch, N + 1, V, D, gen))
    logits = case[0]
    want = verify_greedy_reference(*case, D, with_path=True)
    row = {"B": args.batch, "N": N, "V": V, "D": D, "bit_exact": True,
           "floor_us": logits.numel() * logits.element_size() / bw * 1e6}
    for name, fn in methods.items():
        got, first = timed_call(fn, *case, D)
        row[f"{name}_first_call_s"] = first
        if name != "torch_ref":
            exact = all(torch.equal(g, w) for g, w in zip(got, want))
            row[f"{name}_bit_exact"] = exact
            row["bit_exact"] &= exact
    inputs = [(logits.clone(), *case[1:], D) for _ in range(rotating_copies(logits))]
    for name, fn in methods.items():
        row[f"{name}_gpu_us"] = gpu_us(fn, inputs)
        row[f"{name}_eager_us"] = wall_s(fn, *case, D, warmup=10, repeats=200, device="cuda") * 1e6
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_verify.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to time.",
              file=sys.stderr)
        return 2
    from eagle_mm.kernels.reference import verify_greedy_reference
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton

    def wrap(verify):
        return lambda *a: verify(*a, with_path=True)[:4]

    methods = {"triton": wrap(verify_greedy_triton), "torch_ref": wrap(verify_greedy_reference)}
    if args.compare:
        methods["compare"] = wrap(importlib.import_module(args.compare).verify_greedy_triton)
    bw = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for N in args.nodes:
        for V in args.vocab:
            rows.append(time_shape(args, N, V, bw, gen, methods))
    print(f"\n{torch.cuda.get_device_name(0)}, copy bandwidth {bw / 1e9:.0f} GB/s, B={args.batch}, D={args.depth}, "
          "bf16 logits; us of CUDA-graph replay over rotating inputs (eager: wall clock per call)\n")
    cols = [m for m in methods if m != "torch_ref"]
    print("| N | V | floor | " + " | ".join(f"{m} | {m} / floor" for m in cols)
          + " | torch ref | ref / triton | triton eager | triton first call (s) | bit-exact |")
    print("|---" * (8 + 2 * len(cols)) + "|")
    for r in rows:
        print(f"| {r['N']} | {r['V']} | {r['floor_us']:.2f} | "
              + " | ".join(f"{r[f'{m}_gpu_us']:.2f} | {r[f'{m}_gpu_us'] / r['floor_us']:.2f}x" for m in cols)
              + f" | {r['torch_ref_gpu_us']:.1f} | {r['torch_ref_gpu_us'] / r['triton_gpu_us']:.1f}x"
              f" | {r['triton_eager_us']:.1f} | {r['triton_first_call_s']:.2f} | {r['bit_exact']} |")
    meta = {"copy_bandwidth_GBps": bw / 1e9, "compare": args.compare}
    record("verify_greedy", [{**meta, **r} for r in rows], command="python bench/bench_verify.py "
           + " ".join(sys.argv[1:] if argv is None else argv), path=args.record)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
