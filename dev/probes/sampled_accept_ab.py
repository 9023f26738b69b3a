"""Sampled acceptance of one given tree (4/6/24, T=0.8, top-p 0.95) on code-tiny, CPU fp32: 6 validation prompts x 3
seeds, 96 new tokens each; prints the mean tokens per target forward. Run it on two checkouts to tell a change in
what the draft and the acceptance do from a change in which tree the chooser picks:

    PYTHONPATH=. python dev/probes/sampled_accept_ab.py head
    (cd .pre37 && EAGLE_MM_ZOO_DIR=$PWD/../eagle_mm/zoo/models PYTHONPATH=$PWD python ../dev/probes/sampled_accept_ab.py b360572)
"""
import sys, statistics, torch
import eagle_mm
from eagle_mm import zoo
torch.set_num_threads(2)
m = zoo.load("code-tiny", device="cpu")
model, head, tok = m.target, m.eagle3_head, m.tokenizer
tree = eagle_mm.TreeConfig(depth=4, top_k=6, total_tokens=24)
accs = []
for i, p in enumerate(m.prompts[:6]):
    enc = dict(tok([p], return_tensors="pt"))
    for seed in range(3):
        out = eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=96, min_new_tokens=96, do_sample=True,
                                            temperature=0.8, top_p=0.95, tree=tree,
                                            generator=torch.Generator().manual_seed(100 * i + seed),
                                            return_dict_in_generate=True)
        accs.append(out.stats.mean_accept_length)
print(sys.argv[1], "mean accept", round(statistics.mean(accs), 3), "n", len(accs), [round(a, 2) for a in accs])
