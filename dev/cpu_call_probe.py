"""On a CPU: the default call, no tree and chains of 1 and 2 against HF eager generate at one batch (code-tiny,
fp32, the methods interleaved per round; every row decodes exactly N new tokens). What showed that plain decoding at
batch 32 lost to generate by its sampling noise (torch's exponential_), and that chains lose there.

    PYTHONPATH=. python dev/cpu_call_probe.py sampled 32 32 [ROUNDS] [hf,ours,none,chain1,chain2]
"""
import statistics
import sys
import time

import eagle_mm as em
from eagle_mm import zoo

mode, B, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
m = zoo.load("code-tiny", device="cpu")
model, tok, head = m.target, m.tokenizer, m.eagle3_head
tok.padding_side = "left"; tok.pad_token = tok.pad_token or tok.eos_token
prompts = (m.prompts * (B // len(m.prompts) + 1))[:B]
enc = tok(prompts, return_tensors="pt", padding=True)
kw = dict(max_new_tokens=n, min_new_tokens=n)
if mode == "sampled":
    kw.update(do_sample=True, temperature=0.8, top_p=0.95)
else:
    kw.update(do_sample=False)
methods = {
    "hf": lambda: model.generate(**enc, **kw),
    "ours": lambda: em.speculative_generate(model, head, **enc, **kw, return_dict_in_generate=True),
    "none": lambda: em.speculative_generate(model, head, **enc, **kw, tree=em.TreeConfig.none(), return_dict_in_generate=True),
    "chain1": lambda: em.speculative_generate(model, head, **enc, **kw, tree=em.TreeConfig.chain(1), return_dict_in_generate=True),
    "chain2": lambda: em.speculative_generate(model, head, **enc, **kw, tree=em.TreeConfig.chain(2), return_dict_in_generate=True),
}
want = sys.argv[5].split(",") if len(sys.argv) > 5 else list(methods)
times = {k: [] for k in want}
info = {}
for k in want:
    out = methods[k]()
for r in range(reps):
    for k in want:
        t0 = time.perf_counter(); out = methods[k](); times[k].append(time.perf_counter() - t0)
        if hasattr(out, "stats"):
            s = out.stats
            info[k] = {"accept": round(s.mean_accept_length, 3), "tree": str(s.tree), "path": [ (c.tree.depth, c.tree.top_k, c.tree.total_tokens, c.batch) for c in s.choices],
                       "draft": round(s.time_draft, 3), "verify": round(s.time_verify, 3), "other": round(s.time_other, 3), "prefill": round(s.time_prefill, 3)}
hf = statistics.median(times["hf"]) if "hf" in times else None
for k in want:
    med = statistics.median(times[k])
    print(f"{mode}{B} n={n} {k:7s} {B*n/med:8.1f} tok/s  x hf {hf/med if hf else float('nan'):.2f}  {info.get(k, '')}")
