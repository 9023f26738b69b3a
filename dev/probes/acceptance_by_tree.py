"""Per-position acceptance of forced trees on code-tiny (CPU, fp32, batch 1): the data the chooser's acceptance
model is checked against (dev/probes/acceptance_fit.py). One JSON line per tree: drafts, per-position counts and
the mean accepted length over the validation prompts.

    PYTHONPATH=. python dev/probes/acceptance_by_tree.py --mode greedy --out greedy.jsonl
"""
import argparse
import json

import torch

import eagle_mm
from eagle_mm import zoo
from eagle_mm.config import TreeConfig

TREES = ["1/1/1", "2/1/2", "3/1/3", "5/1/5", "8/1/8", "2/6/16", "2/8/24", "3/4/12", "3/8/48", "4/2/6", "4/4/16",
         "4/6/24", "5/4/16", "5/8/64", "6/8/48", "7/4/32", "8/8/64"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("greedy", "sampled"), default="greedy")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    m = zoo.load("code-tiny", device="cpu")
    model, head, tok = m.target, m.eagle3_head, m.tokenizer
    with open(a.out, "w") as f:
        for name in TREES:
            d, k, n = (int(x) for x in name.split("/"))
            tree = TreeConfig.chain(d) if k == 1 else TreeConfig(d, k, n)
            drafts, counts, tokens, forwards = 0, [0] * d, 0, 0
            for i, prompt in enumerate((m.prompts * 4)[: a.prompts]):
                enc = tok([prompt], return_tensors="pt")
                kw = dict(do_sample=True, temperature=0.8, top_p=0.95) if a.mode == "sampled" else dict(do_sample=False)
                out = eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=a.new_tokens,
                                                    min_new_tokens=a.new_tokens, tree=tree, return_dict_in_generate=True,
                                                    generator=torch.Generator().manual_seed(i), **kw)
                s = out.stats
                drafts += s.num_drafts
                counts = [c + x for c, x in zip(counts, s.accept_counts)]
                forwards += s.num_target_forwards
                tokens += out.sequences.shape[1] - enc["input_ids"].shape[1]
            rec = {"mode": a.mode, "tree": [d, k, n if k > 1 else d], "drafts": drafts, "counts": counts,
                   "rates": [round(c / drafts, 4) for c in counts], "mean_accept": round(1 + sum(counts) / drafts, 4)}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
