"""Consecutive default calls of one shape, each's cost split: wall, prefill, draft/verify/other, what it spent
capturing, the graphs the runner holds, the storage's generation and the trees it ran. Repeated calls of one shape
should capture nothing after the first ones (the chooser keeps the buffers' size and weighs captures).

    PYTHONPATH=. python dev/gpu/chooser_calls.py --rows greedy1 greedy16 greedy64 sampled64 --calls 6
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import eagle_mm
from eagle_mm import zoo


def row_inputs(m, row: str, dev, new_tokens: int):
    """("greedy"|"sampled", batch, generate kwargs) of a row named like "sampled16": code-tiny's validation prompts
    repeated to fill the batch (left-padded), every row decoding ``new_tokens``."""
    mode, batch = row.rstrip("0123456789"), int(row[len(row.rstrip("0123456789")):])
    tok = m.tokenizer
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    prompts = (m.prompts * (batch // len(m.prompts) + 1))[:batch]
    enc = dict(tok(prompts, return_tensors="pt", padding=True).to(dev))
    sample = dict(do_sample=True, temperature=0.8, top_p=0.95) if mode == "sampled" else dict(do_sample=False)
    return mode, batch, dict(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sample)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", nargs="+", default=["greedy1", "greedy16", "greedy64", "sampled64"])
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = zoo.load("code-tiny", device=dev)
    model, head = m.target, m.eagle3_head
    rows = []
    for row in args.rows:
        mode, batch, kw = row_inputs(m, row, dev, args.new_tokens)
        dec = eagle_mm.decoder(model, head)
        for i in range(args.calls):
            torch.cuda.synchronize() if dev.type == "cuda" else None
            t = time.perf_counter()
            out = eagle_mm.speculative_generate(model, head, **kw, return_dict_in_generate=True)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            wall = time.perf_counter() - t
            s = out.stats
            rec = {"row": row, "call": i, "wall_s": wall, "prefill_s": s.time_prefill, "draft_s": s.time_draft,
                   "verify_s": s.time_verify, "other_s": s.time_other, "setup_s": s.time_compile,
                   "forwards": s.num_target_forwards, "accept": s.mean_accept_length,
                   "captures": dec.runner.captures, "generation": dec.storage.generation,
                   "cache_slots": dec.storage.length,
                   "path": [f"{c.tree.depth}/{c.tree.top_k}/{c.tree.total_tokens}@{c.batch}:{c.why[:4]}"
                            for c in s.choices]}
            rows.append(rec)
            print(json.dumps(rec), flush=True)
        t = time.perf_counter()
        for _ in range(3):
            model.generate(**kw, cache_implementation="static")
        torch.cuda.synchronize() if dev.type == "cuda" else None
        print(json.dumps({"row": row, "hf_static_s": (time.perf_counter() - t) / 3}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
