"""Speculative decoding on the scenes-tiny VLM: does a drafter gain from seeing the image? One process, greedy.

Methods, on the same validation scenes (picture + question, the image right before the answer): plain
``model.generate``; the image-aware EAGLE-3 head (``eagle3``: at image positions it reads the merged image
embeddings), the ablation (``eagle3-noimage``: the placeholder token's embedding there) and the stricter ablation
(``eagle3-blind``: also zeros for the target's features there, so nothing of the image's positions), each with the
default tree and a chain. Reported per method: its first call (timed apart, right before its timed calls), wall
time and speed-up over ``generate``, whether every output equals ``generate``'s token for token, ``SpeculativeStats.mean_accept_length`` (tokens per verify forward, bonus
included, before stopping truncation) over all prompts, and the same right after the image: tokens committed
per cycle over the first ``--first-cycles`` cycles of each answer (counted from what the loop commits, so an
answer that ends early counts only its tokens), and per task.

    python bench/bench_scenes_tiny.py --out scenes_tiny.json                      # the zoo's scenes-tiny
    python bench/bench_scenes_tiny.py --path BUILD_DIR --device cuda --out scenes_tiny_h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_record_arg, record, timed_call  # noqa: E402

METHODS = ("generate", "eagle3_tree", "eagle3_chain", "noimage_tree", "noimage_chain", "blind_tree", "blind_chain")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=None, help="a scenes-tiny build directory (default: eagle_mm.zoo's)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--examples", type=int, default=24, help="validation examples (scenes 0.., one question each)")
    p.add_argument("--tasks", nargs="+", default=None, help="restrict the questions to these tasks")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--first-cycles", type=int, default=2, help="cycles counted as 'right after the image'")
    p.add_argument("--chain-depth", type=int, default=5)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_record_arg(p)
    return p.parse_args(argv)


class CycleRecorder:
    """A streamer that keeps how many tokens each put() brings: the prompt, the prefill's token, then per cycle."""

    def __init__(self):
        self.sizes: list[int] = []

    def put(self, value):
        self.sizes.append(int(value.numel()))

    def end(self):
        pass

    @property
    def cycles(self) -> list[int]:
        return self.sizes[2:]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(zm, examples, args) -> dict:
    """Every method over every example; returns the report (without environment facts)."""
    from eagle_mm import TreeConfig, speculative_generate

    device = zm.target.device
    trees = {"tree": zm.demo_tree(), "chain": TreeConfig.chain(args.chain_depth)}
    heads = {"eagle3": zm.head, "noimage": zm.ablation_head, "blind": zm.blind_head}
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    inputs = [zm.inputs(ex["image"], ex["prompt"]) for ex in examples]

    def call(method, x, streamer=None):
        if method == "generate":
            return zm.target.generate(**x, **kw), None
        name, shape = method.split("_")
        out = speculative_generate(zm.target, heads[name], **x, tree=trees[shape], return_dict_in_generate=True,
                                   streamer=streamer, **kw)
        return out.sequences, out.stats

    methods = ["generate"] + [m for m in args.methods if m != "generate"]  # generate first: the reference
    with torch.no_grad():
        refs, report = [], {}
        for m in methods:
            # Each method's first call right before its timing, timed apart: one-time costs (allocator, kernels,
            # compilation) stay out of the timed calls, and each method starts as warm as the others.
            _, first = timed_call(call, m, inputs[0], device=device)
            seqs, stats, recs = [], [], []
            _sync(device)
            tick = time.perf_counter()
            for x in inputs:
                rec = CycleRecorder() if m != "generate" else None
                s, st = call(m, x, rec)
                seqs.append(s)
                stats.append(st)
                recs.append(rec)
            _sync(device)
            report[m] = {"seconds": time.perf_counter() - tick, "first_call_s": first,
                         "new_tokens": sum(int(s.shape[1] - x["input_ids"].shape[1]) for s, x in zip(seqs, inputs))}
            if m == "generate":
                refs = seqs
                continue
            report[m].update(_acceptance(stats, recs, examples, args.first_cycles))
            if refs:
                report[m]["identical"] = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(seqs, refs))
    if "generate" in report:
        for m, r in report.items():
            r["speedup"] = report["generate"]["seconds"] / r["seconds"]
    return report


def _acceptance(stats, recs, examples, first: int) -> dict:
    accepted = sum(s.accepted_tokens for s in stats)
    drafts = sum(s.num_drafts for s in stats)
    early = [c for r in recs for c in r.cycles[:first]]
    per_task = {}
    for task in sorted({ex["task"] for ex in examples}):
        cyc = [c for r, ex in zip(recs, examples) if ex["task"] == task for c in r.cycles]
        per_task[task] = sum(cyc) / len(cyc) if cyc else None
    counts = np.sum([s.accept_counts for s in stats], axis=0)
    return {"mean_accept_length": accepted / drafts if drafts else 0.0,
            "accept_rate_per_position": (counts / max(drafts, 1)).tolist(),
            "first_cycles_tokens_per_cycle": sum(early) / len(early) if early else None,
            "tokens_per_cycle": sum(sum(r.cycles) for r in recs) / max(1, sum(len(r.cycles) for r in recs)),
            "tokens_per_cycle_by_task": per_task, "target_forwards": sum(s.num_target_forwards for s in stats)}


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    from eagle_mm import zoo
    from eagle_mm.zoo import scenes_data as sd

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    zm = zoo.load_scenes_dir(args.path, device=device) if args.path else zoo.load("scenes-tiny", device=device)
    examples = list(sd.examples("validation", args.examples, size=zm.image_size, tasks=args.tasks))
    results = run(zm, examples, args)
    out = {"model": str(zm.path), "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "dtype": str(zm.target.dtype), "examples": len(examples),
           "tasks": {t: sum(ex["task"] == t for ex in examples) for t in sd.TASKS},
           "max_new_tokens": args.max_new_tokens, "first_cycles": args.first_cycles,
           "trees": {"tree": dataclasses.asdict(zm.demo_tree()), "chain_depth": args.chain_depth},
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "results": results}
    text = json.dumps(out, indent=1, default=str)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    record("scenes_tiny", [{"method": m, "model": out["model"], "device": out["device"], "examples": out["examples"],
                            **r} for m, r in results.items()],
           command="python bench/bench_scenes_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv),
           path=args.record)
    for m, r in results.items():
        print(f"{m:14s} {r['seconds']:7.2f}s speedup {r['speedup']:.2f}"
              + (f" accept {r['mean_accept_length']:.2f} first {r['first_cycles_tokens_per_cycle'] or 0:.2f}"
                 f" identical {r.get('identical')}" if m != "generate" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
