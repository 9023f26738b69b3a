"""A given tree on a CPU with and without ``skinny.py``'s few-row linears, against ``generate``: code-tiny, greedy,
``TreeConfig.none()`` (one token per verify), interleaved per repeat in one process, ms per token (medians).

    python dev/probes/user_tree_linears.py [--batches 4 16] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new", type=int, default=64)
    a = p.parse_args()
    import eagle_mm
    from eagle_mm import zoo
    from eagle_mm.decode import loop

    m = zoo.load("code-tiny", device=torch.device("cpu"))
    tok = m.tokenizer
    tok.padding_side = "left"
    measured = loop.few_row_linears
    for b in a.batches:
        enc = dict(tok((m.prompts * b)[:b], return_tensors="pt", padding=True))
        kw = dict(**enc, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)

        def ours(few_rows):
            def run():
                loop.few_row_linears = few_rows
                try:
                    return eagle_mm.speculative_generate(m.target, m.eagle3_head, **kw, tree=eagle_mm.TreeConfig.none())
                finally:
                    loop.few_row_linears = measured
            return run
        methods = {"generate": lambda: m.target.generate(**kw), "few-row linears": ours(lambda *_: True),
                   "F.linear": ours(lambda *_: False), "as measured": ours(measured)}
        for f in methods.values():
            f()
        times = {k: [] for k in methods}
        for _ in range(a.repeats):
            for k, f in methods.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        print(f"batch {b}: " + ", ".join(f"{k} {1e3 * statistics.median(v) / a.new:.2f}" for k, v in times.items())
              + " ms/token", flush=True)


if __name__ == "__main__":
    main()
