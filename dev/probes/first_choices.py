"""Sampled acceptance counts and first-choice counts of given trees on code-tiny, CPU fp32 (T=0.8, top-p 0.95, 128
new tokens, 3 validation prompts x 3 seeds), into OUT as {tree: [[drafts, accept_counts, first_counts], ...]}: the
data behind the acceptance fit's first-choice term (docs/trees.md).

    PYTHONPATH=. python dev/probes/first_choices.py OUT.json 3/6/24 4/4/16 2/1/2
"""
import json
import sys

import torch

import eagle_mm
from eagle_mm import zoo
torch.set_num_threads(2)
m = zoo.load("code-tiny", device="cpu")
model, head, tok = m.target, m.eagle3_head, m.tokenizer
res = {}
for spec in sys.argv[2:]:
    d, k, n = map(int, spec.split("/"))
    tree = eagle_mm.TreeConfig(depth=d, top_k=k, total_tokens=n)
    per = []
    for pi in range(3):
        enc = dict(tok([m.prompts[pi]], return_tensors="pt"))
        for seed in range(3):
            out = eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=128, min_new_tokens=128, do_sample=True,
                temperature=0.8, top_p=0.95, tree=tree, generator=torch.Generator().manual_seed(seed), return_dict_in_generate=True)
            per.append((out.stats.num_drafts, list(out.stats.accept_counts), list(out.stats.first_counts)))
    res[spec] = per
    print(spec, sum(p[0] for p in per), [sum(p[1][i] for p in per) for i in range(d)], [sum(p[2][i] for p in per) for i in range(d)], flush=True)
json.dump(res, open(sys.argv[1], "w"))
