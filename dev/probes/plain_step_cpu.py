"""The default call's plain step (``TreeConfig.none()``: one token per target forward) against eager ``generate`` on
a CPU, and where each spends its time: code-tiny, greedy, ``--batch`` rows, 128 new tokens, the two interleaved
(median of 5), then one cProfile of each, the top functions by their own time. For a CPU where the plain step lost
to ``generate`` (the H100 host of dev/results/ab13_h100_2026-12-06: 14 ms a forward against 8.4), run pinned:

    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 taskset -c 0,1 python dev/probes/plain_step_cpu.py --batch 1
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import eagle_mm  # noqa: E402
from eagle_mm import zoo  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    m = zoo.load("code-tiny", device="cpu")
    model, head, tok = m.target, m.eagle3_head, m.tokenizer
    tok.padding_side = "left"
    prompts = (m.prompts * (args.batch // len(m.prompts) + 1))[: args.batch]
    enc = dict(tok(prompts, return_tensors="pt", padding=True))
    common = dict(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    calls = {"generate": lambda: model.generate(**common),
             "plain step": lambda: eagle_mm.speculative_generate(model, head, **common, tree=eagle_mm.TreeConfig.none())}
    for f in calls.values():
        f()
    times = {k: [] for k in calls}
    for _ in range(5):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, batch {args.batch}: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in med.items())
          + f"; plain step / generate {med['plain step'] / med['generate']:.2f}")
    for k, f in calls.items():
        prof = cProfile.Profile()
        prof.enable()
        f()
        prof.disable()
        own: dict = {}
        for (_, _, name), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():
            own[name] = own.get(name, 0.0) + tt
        top = sorted(own.items(), key=lambda x: -x[1])[: args.top]
        print(f"{k}: {sum(own.values()):.3f} s profiled; own time: " + ", ".join(f"{n} {t:.3f}" for n, t in top))


if __name__ == "__main__":
    main()
