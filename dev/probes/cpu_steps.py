"""Where a CPU's decode step goes: HF eager ``generate`` against the engine without a tree and the default call.

code-tiny fp32, greedy, its validation prompts at batch 1 and 4, ``--new-tokens`` per row. Per method: the median
of ``--repeats`` timed calls (after one untimed), seconds per committed token per row, the tree the default call
drafted; then one call of each under ``torch.profiler`` (CPU), its top ops by self time, to a text file. Written for
a CPU the chooser lost on (the GPU host's, 2 cores pinned), where the engine's plain step measured 1.3x generate's.

    CUDA_VISIBLE_DEVICES= taskset -c 0,1 PYTHONPATH=. python dev/probes/cpu_steps.py --out DIR
"""
import argparse
import json
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import eagle_mm
    from eagle_mm import zoo
    from eagle_mm.config import TreeConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    m = zoo.load("code-tiny", device=torch.device("cpu"))
    model, head, tok = m.target, m.eagle3_head, m.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": []}
    for b in a.batches:
        prompts = (m.prompts * (b // len(m.prompts) + 1))[:b]
        enc = dict(tok(prompts, return_tensors="pt", padding=True))
        n = a.new_tokens
        common = dict(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        methods = {
            "hf_eager": lambda: model.generate(**common),
            "ours_none": lambda: eagle_mm.speculative_generate(model, head, **common, tree=TreeConfig.none(),
                                                               return_dict_in_generate=True),
            "ours_default": lambda: eagle_mm.speculative_generate(model, head, **common,
                                                                  return_dict_in_generate=True),
        }
        row = {"batch": b, "new_tokens": n}
        for name, fn in methods.items():
            fn()
            times, out = [], None
            for _ in range(a.repeats):
                t = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            row[name] = {"median_s": med, "ms_per_token": 1e3 * med / n, "times": times}
            if hasattr(out, "stats"):
                s = out.stats
                row[name].update(tree=str(s.choices[0].tree) if s.choices else None,
                                 accept=s.mean_accept_length, forwards=s.num_target_forwards,
                                 draft_s=s.time_draft, verify_s=s.time_verify, other_s=s.time_other,
                                 prefill_s=getattr(s, "time_prefill", None),
                                 choices=[str(c) for c in s.choices[:2]])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            with open(os.path.join(a.out, f"prof_b{b}_{name}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            print(b, name, {k: v for k, v in row[name].items() if k not in ("times", "choices")}, flush=True)
        result["rows"].append(row)
    with open(os.path.join(a.out, "cpu_steps.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
