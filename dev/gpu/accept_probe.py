"""The greedy acceptance's Triton kernel against its torch reference, each captured in a CUDA graph as the engine
runs it (``steps.accept_step``), and eagerly: microseconds per call at the engine's shapes. Whether the kernel pays
for the ~2 s its first use costs a fresh machine (Triton's launcher builds, driver and cache key: the cold first
call's profile, dev/results/).

    PYTHONPATH=. python dev/gpu/accept_probe.py
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eagle_mm.kernels import verify_greedy  # noqa: E402

SHAPES = [(1, 65, 8192, 4), (16, 65, 8192, 6), (64, 1, 8192, 0), (1, 33, 128256, 5), (4, 65, 128256, 6)]


def random_tree(B: int, n: int, gen: torch.Generator, max_depth: int):
    """Random trees (B, n) no deeper than max_depth: parent[i] < i among the nodes above max_depth."""
    parent = torch.zeros(B, n, dtype=torch.long)
    depth = torch.zeros(B, n, dtype=torch.long)
    for b in range(B):
        for i in range(1, n):
            ok = (depth[b, :i] < max_depth).nonzero().flatten()
            p = int(ok[torch.randint(0, len(ok), (1,), generator=gen)])
            parent[b, i], depth[b, i] = p, depth[b, p] + 1
    return parent, depth


def per_call(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    g = torch.Generator().manual_seed(0)
    for B, n, V, D in SHAPES:
        logits = torch.randn(B, n, V, generator=g).to("cuda", torch.bfloat16)
        parent, depth = random_tree(B, n, g, max_depth=D) if n > 1 else (torch.zeros(B, 1, dtype=torch.long),) * 2
        tokens = torch.randint(V, (B, n), generator=g)
        parent, depth, tokens = (t.to("cuda") for t in (parent, depth, tokens))
        D = int(depth.max())
        row = []
        for backend in ("triton", "torch"):
            f = lambda b=backend: verify_greedy(logits, tokens, parent, depth, D, with_path=True, backend=b)  # noqa
            eager = per_call(f)
            graph = torch.cuda.CUDAGraph()
            f()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                f()
            replay = per_call(graph.replay)
            row.append(f"{backend}: eager {eager:.1f} us, graph {replay:.1f} us")
        print(f"B={B} nodes={n} V={V} depth={D}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
