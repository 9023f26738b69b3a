"""Which tree should the CPU default draft? code-tiny (fp32, this machine), batch 1, 128 new tokens, greedy and
sampled (T=0.8, top-p 0.95): eager generate against the default call with each candidate tree, in rounds.

    PYTHONPATH=. python dev/cpu_tree_sweep.py
"""
import statistics
import time

import torch

import eagle_mm
from eagle_mm import zoo

m = zoo.load("code-tiny", device="cpu")
model, head, tok = m.target, m.eagle3_head, m.tokenizer
import os
enc = dict(tok([m.prompts[int(os.environ.get("PROMPT", "0"))]], return_tensors="pt"))
N = 128
TREES = {"chain2": eagle_mm.TreeConfig.chain(2), "chain3": eagle_mm.TreeConfig.chain(3),
         "chain4": eagle_mm.TreeConfig.chain(4), "chain5": eagle_mm.TreeConfig.chain(5),
         "t3_2_4": eagle_mm.TreeConfig(depth=3, top_k=2, total_tokens=4),
         "t4_2_6": eagle_mm.TreeConfig(depth=4, top_k=2, total_tokens=6)}
for mode, sample in (("greedy", dict(do_sample=False)), ("sampled", dict(do_sample=True, temperature=0.8, top_p=0.95))):
    common = dict(**enc, max_new_tokens=N, min_new_tokens=N, **sample)
    calls = {"generate": lambda: model.generate(**common)}
    for name, tree in TREES.items():
        calls[name] = lambda tree=tree: eagle_mm.speculative_generate(model, head, tree=tree, **common,
                                                                      generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in calls}
    for r in range(4):
        for k, f in calls.items():
            t = time.perf_counter()
            f()
            if r:
                times[k].append(time.perf_counter() - t)
    base = statistics.median(times["generate"])
    print(mode, {k: round(base / statistics.median(v), 3) for k, v in times.items()}, flush=True)
