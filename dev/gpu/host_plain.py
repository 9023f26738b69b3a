"""Why decoding without a tree ran slower than HF's eager generate on the GPU host's CPU (2 cores pinned; ab18: greedy
batch 1 0.685 against 0.581 s, sampled batch 1 1.124 against 0.863 s), while on this project's CPU the two are within
2%. Per row (greedy1, sampled1, greedy16): HF eager and ours with TreeConfig.none() in turns (3 each, after a warm
call), the chooser's probed costs for the batch (the few-row linears' verify sizes), then torch.profiler's top ops
by self CPU time for one call of each.
    CUDA_VISIBLE_DEVICES= taskset -c 0,1 python dev/gpu/host_plain.py
"""
from __future__ import annotations

import time

import torch

import eagle_mm
from eagle_mm import TreeConfig, zoo


def main() -> None:
    m = zoo.load("code-tiny", device=torch.device("cpu"))
    model, tok, head = m.target, m.tokenizer, m.eagle3_head
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    print("torch", torch.__version__, "threads", torch.get_num_threads(), flush=True)
    for mode, batch in (("greedy", 1), ("sampled", 1), ("greedy", 16)):
        enc = dict(tok((m.prompts * 16)[:batch], return_tensors="pt", padding=True))
        kw = dict(max_new_tokens=128, min_new_tokens=128)
        kw.update(dict(do_sample=True, temperature=0.8, top_p=0.95) if mode == "sampled" else dict(do_sample=False))
        gen = (lambda: torch.Generator().manual_seed(1)) if mode == "sampled" else (lambda: None)
        calls = {"hf": lambda: model.generate(**enc, **kw),
                 "ours_plain": lambda: eagle_mm.speculative_generate(model, head, **enc, **kw, generator=gen(),
                                                                     tree=TreeConfig.none()),
                 "ours_default": lambda: eagle_mm.speculative_generate(model, head, **enc, **kw, generator=gen())}
        for f in calls.values():
            f()
        times = {k: [] for k in calls}
        for _ in range(3):
            for k, f in calls.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        print(f"{mode}{batch}", {k: [round(x, 3) for x in v] for k, v in times.items()}, flush=True)
        table = eagle_mm.decoder(model, head).chooser.entries
        print("  costs", {n: {"verify": c.verify[:3], "skinny": c.skinny, "advance": c.advance}
                          for n, c in table.items() if n.startswith(f"{batch}/")}, flush=True)
        for k in ("hf", "ours_plain"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                calls[k]()
            print(f"  profile {k}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14),
                  flush=True)


if __name__ == "__main__":
    main()
