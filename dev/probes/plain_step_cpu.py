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
    p.add_argument("--ops", action="store_true", help="also torch.profiler's operator table of each (self CPU time)")
    p.add_argument("--after-default", action="store_true",
                   help="first one default call (it probes this CPU's step costs and keeps them on disk, which a "
                        "given tree then reads: whether its forwards take skinny.py's few-row linears); also time "
                        "the default call and print the probe's few-row verdicts")
    args = p.parse_args()
    m = zoo.load("code-tiny", device="cpu")
    model, head, tok = m.target, m.eagle3_head, m.tokenizer
    tok.padding_side = "left"
    prompts = (m.prompts * (args.batch // len(m.prompts) + 1))[: args.batch]
    enc = dict(tok(prompts, return_tensors="pt", padding=True))
    common = dict(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    calls = {"generate": lambda: model.generate(**common),
             "plain step": lambda: eagle_mm.speculative_generate(model, head, **common, tree=eagle_mm.TreeConfig.none())}
    if args.after_default:
        from eagle_mm.decode.cost_cache import decode_kind

        out = eagle_mm.speculative_generate(model, head, **common, return_dict_in_generate=True)
        table = eagle_mm.decoder(model, head).chooser.table(decode_kind(None, False, torch.device("cpu")))
        for b, costs in sorted(table.items()):
            print(f"probe at batch {b}: verify {[(q, round(1e3 * t, 2)) for q, t in costs.verify]} ms, few-row "
                  f"linears at q = {list(costs.skinny)}, advance {1e3 * costs.advance:.2f} ms")
        print(f"default call: trees {[c.tree for c in out.stats.choices]}")
        calls["default call"] = lambda: eagle_mm.speculative_generate(model, head, **common)
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
          + "; / generate: " + ", ".join(f"{k} {v / med['generate']:.2f}" for k, v in med.items() if k != "generate"))
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
    if args.ops:  # the same work seen by operator: which aten calls differ between the two (and by how much)
        print(torch.__config__.parallel_info())
        for k, f in calls.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                f()
            print(f"{k}, operators by self CPU time:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top + 6))


if __name__ == "__main__":
    main()
