"""Benchmark sampling tree verification (recursive rejection sampling) on a CUDA GPU.

For each tree size N and vocabulary V (B rows, depth <= D): a random tree whose nodes are drawn near the
newest ones (so it gets deep), fp32 processed logits (B, N+1, V) with one planted likely path, and a
peaked draft q = softmax(logits + noise), so that some nodes are accepted and some rejected. It times
  triton:   eagle_mm.kernels.verify_sampling(backend="triton"): one launch, softmax of visited rows only;
  torch:    the reference, softmax over every node + eagle_mm.decode.sampling.rejection_walk, eager;
  compiled: the same reference under torch.compile(fullgraph=True, mode="reduce-overhead"), for the N in
            --compile-nodes only (the walk unrolls over the nodes: compiling N=128 takes minutes).
Timings from bench/harness.py, after untimed warm-up calls:
  gpu:   CUDA-graph replay of calls over rotating copies of the inputs (up to 8 copies, each with its own
         noise): the device time, no launch overhead (not for "compiled", which replays its own graphs);
  eager: wall clock per call over back-to-back calls: what an un-graphed decode loop pays;
  compile_s: the compiled reference's first calls (compilation), apart.
Equality: for --draws noise draws per shape (u, e as eagle_mm.decode.sampling draws them), Triton's
(accept_len, best, bonus) must equal the reference's; mismatches are counted, and the exit status is 1
if any. The compiled reference is compared too (compiled_exact), for information. Exit status 2 without
CUDA. Prints a markdown table; --record appends the rows to bench/results.jsonl. Run from the repository
root with the package importable (pip install -e . or PYTHONPATH=.):

    PYTHONPATH=. python bench/bench_verify_sampling.py --record
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_verify import add_shape_args, random_tree  # noqa: E402
from harness import add_record_arg, gpu_us, record, wall_s  # noqa: E402

DEVICE = "cuda"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--draws", type=int, default=16, help="noise draws per shape for the equality check")
    p.add_argument("--compile-nodes", type=int, nargs="*", default=[16],
                   help="the N at which to time the torch.compile'd reference (none: skip it)")
    add_record_arg(p)
    return p.parse_args(argv)


def make_case(B: int, n: int, V: int, max_depth: int, gen: torch.Generator):
    """tokens, parent (B, n) on the CPU; scores, q (B, n, V) fp32 on the GPU. One root-to-leaf path per row
    is planted as its parents' likely tokens (logit 15: p ~ 0.9 even at V = 152k)."""
    parent, _ = random_tree(B, n, max_depth, gen)
    tokens = torch.randint(0, V, (B, n), generator=gen)
    dev_gen = torch.Generator(DEVICE).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    scores = torch.randn(B, n, V, device=DEVICE, generator=dev_gen)  # (B, n, V)
    for b in range(B):
        node = n - 1
        while node != 0:
            scores[b, parent[b, node], tokens[b, node]] = 15.0
            node = parent[b, node].item()
    # The draft: the target's logits blurred by unit noise, so it is right about the planted path only
    # roughly, and every token has some draft mass.
    q = torch.softmax(scores + torch.randn(B, n, V, device=DEVICE, generator=dev_gen), -1)
    return tokens, parent, scores, q


def noise(B: int, n: int, V: int, seed: int):
    """u (B, n), e (B, V) drawn as speculative decoding draws them (eagle_mm.decode.sampling), from a seeded generator."""
    from eagle_mm.decode.sampling import _noise  # here: the no-CUDA exit needs no package import

    return _noise(B, n, V, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(seed))


def eager_us(fn, args, calls: int = 20) -> float:
    """Wall clock per call (us) after 3 untimed calls; few calls, since the eager reference takes tens of ms."""
    return wall_s(fn, *args, warmup=3, repeats=calls, device=DEVICE) * 1e6


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _reference(tokens, parent, scores, q, u, e):
    """The torch oracle: softmax at every node, then the walk (eagle_mm.kernels.verify_sampling's reference)."""
    from eagle_mm.decode.sampling import rejection_walk  # here: the no-CUDA exit needs no package import
    return rejection_walk(tokens, parent, torch.softmax(scores, -1), q, u, e)


def time_shape(args, N: int, V: int, gen: torch.Generator, compiled) -> dict:
    from eagle_mm.kernels import verify_sampling

    B, n = args.batch, N + 1
    tokens, parent, scores, q = make_case(B, n, V, args.depth, gen)
    tokens, parent = tokens.to(DEVICE), parent.to(DEVICE)

    def triton_fn(s, q_, u, e):
        return verify_sampling(s, q_, tokens, parent, u, e, backend="triton")

    def torch_fn(s, q_, u, e):
        return _reference(tokens, parent, s, q_, u, e)

    draws = [noise(B, n, V, seed) for seed in range(args.draws)]
    want = [torch_fn(scores, q, u, e) for u, e in draws]
    mismatches = sum(not _same(triton_fn(scores, q, u, e), w) for (u, e), w in zip(draws, want))
    row = {"B": B, "N": N, "V": V, "D": args.depth, "draws": args.draws, "mismatches": mismatches,
           "mean_accept_len": sum(w[0].float().mean().item() for w in want) / len(want)}

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    size = 2 * scores.numel() * scores.element_size()  # scores + q
    copies = min(8, max(2, -(-4 * l2 // size)))
    inputs = [(scores.clone(), q.clone(), *draws[i % len(draws)]) for i in range(copies)]
    row["triton_gpu_us"] = gpu_us(triton_fn, inputs, replays=20)
    row["triton_eager_us"] = eager_us(triton_fn, (scores, q, *draws[0]))
    row["torch_gpu_us"] = gpu_us(torch_fn, inputs, replays=3)
    row["torch_eager_us"] = eager_us(torch_fn, (scores, q, *draws[0]))
    del inputs
    if compiled is not None and N in args.compile_nodes:
        def compiled_fn(s, q_, u, e):
            return compiled(tokens, parent, s, q_, u, e)

        try:
            t0 = time.perf_counter()
            got = [tuple(t.clone() for t in compiled_fn(scores, q, u, e)) for u, e in draws]
            row["compile_s"] = time.perf_counter() - t0
            row["compiled_exact"] = all(_same(g, w) for g, w in zip(got, want))
            row["compiled_eager_us"] = eager_us(compiled_fn, (scores, q, *draws[0]))
        except Exception as err:  # a compile failure is a result to record, not a reason to stop
            row["compiled_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    return row


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_verify_sampling.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to time.",
              file=sys.stderr)
        return 2
    compiled = None
    if args.compile_nodes:
        compiled = torch.compile(_reference, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for N in args.nodes:
        for V in args.vocab:
            row = time_shape(args, N, V, gen, compiled)
            rows.append(row)
            print(f"N={N} V={V}: triton {row['triton_gpu_us']:.1f} us gpu / {row['triton_eager_us']:.1f} us eager, "
                  f"torch {row['torch_gpu_us']:.1f} / {row['torch_eager_us']:.1f}, compiled "
                  f"{_fmt(row.get('compiled_eager_us'))} us, mismatches {row['mismatches']}/{row['draws']}",
                  file=sys.stderr)

    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name}, B={args.batch}, D={args.depth}, fp32 scores and q; gpu = CUDA-graph replay over "
          "rotating inputs, eager = wall clock per call\n")
    print("| N | V | mean accept | triton gpu us | triton eager us | torch gpu us | torch eager us "
          "| compiled eager us | triton = torch | compiled = torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        exact = "yes" if r["mismatches"] == 0 else f"no ({r['mismatches']}/{r['draws']})"
        print(f"| {r['N']} | {r['V']} | {r['mean_accept_len']:.2f} | {r['triton_gpu_us']:.1f} "
              f"| {r['triton_eager_us']:.1f} | {r['torch_gpu_us']:.1f} | {r['torch_eager_us']:.1f} "
              f"| {_fmt(r.get('compiled_eager_us'))} | {exact} | {r.get('compiled_exact', '-')} |")
    for r in rows:
        if "compiled_error" in r:
            print(f"compiled reference failed at N={r['N']} V={r['V']}: {r['compiled_error']}")
    record("verify_sampling", rows, command="python bench/bench_verify_sampling.py "
           + " ".join(sys.argv[1:] if argv is None else argv), path=args.record)
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
