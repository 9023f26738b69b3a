"""Benchmark tree="auto": the tree ``choose_tree`` picks against the default TreeConfig(), measured.

Calibrates on a prompt (``eagle_mm.decode.autotree.choose_tree``: device costs + greedy acceptance replay), then
runs ``speculative_generate`` on the same prompt with the chosen tree and with TreeConfig(), and
``model.generate`` for reference, all in one process. Prints the calibration's table and predicted vs
measured tokens/s and accept lengths; --out writes JSON.

Target: a tiny random llama on CPU (default), or with --cuda a random-init target of Llama-3.1-8B's
shape in bf16. Head: --head noisy (default) proposes the target's own greedy continuation with noise
(``tests.test_autotree.NoisyHead``; --strength sets its accuracy), so acceptance is realistic without a
trained head; --head random is a fresh EAGLE-3 head (almost nothing accepted). Run from the repository
root with the package importable (pip install -e . or PYTHONPATH=.):

    python bench/bench_autotree.py --out autotree.json
    python bench/bench_autotree.py --cuda --out autotree_8b.json
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import torch

import eagle_mm

from bench.harness import timed_call
from bench.shapes import SHAPE_8B, random_8b_target



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="8B-shaped bf16 target on the GPU (else tiny llama on CPU)")
    p.add_argument("--layers", type=int, default=32, help="target layers with --cuda (fewer for a quick run)")
    p.add_argument("--head", choices=("noisy", "random"), default="noisy")
    p.add_argument("--strength", type=float, default=2.5, help="NoisyHead margin: higher = more accepted")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per measured run")
    p.add_argument("--calib-tokens", type=int, default=64, help="greedy tokens replayed by the calibration")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats per cost (median)")
    p.add_argument("--runs", type=int, default=5, help="measured generations per tree (median)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def build(args):
    if not args.cuda:
        from tests.tiny import tiny_model

        return tiny_model("llama")
    model = random_8b_target(args.layers)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def timed(fns: dict, runs: int, device) -> tuple[dict, dict, dict]:
    """Each fn's first call timed alone, then ``runs`` rounds in which every fn runs once (a slow spell of a
    shared machine falls on all of them): median seconds, first-call seconds and last result per name."""
    outs, first = {}, {}
    for name, fn in fns.items():
        outs[name], first[name] = timed_call(fn, device=device)
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            outs[name], took = timed_call(fn, device=device)
            times[name].append(took)
    return {name: statistics.median(t) for name, t in times.items()}, first, outs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cuda and not torch.cuda.is_available():
        print("--cuda needs a CUDA GPU: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import eagle_mm as em
    from eagle_mm.decode.autotree import choose_tree

    model = build(args)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(model.config.vocab_size, 1000), (1, args.prompt_len), generator=gen).to(device)
    head = em.Eagle3Head.from_target(model).to(device=device, dtype=model.dtype)
    if args.head == "noisy":
        from tests.test_autotree import NoisyHead

        extra = max(args.new_tokens, args.calib_tokens) + 16
        reference = model.generate(ids, max_new_tokens=extra, do_sample=False)[0]
        head = NoisyHead(head, reference, args.strength)

    result = choose_tree(model, head, ids, max_new_tokens=args.calib_tokens, repeats=args.repeats, decode=eagle_mm.speculative_generate)
    print(result.table(12))
    estimates = {"auto": result.chosen, "default": result.default}
    fns = {"model.generate": lambda: model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)}
    for name, estimate in estimates.items():
        fns[name] = lambda tree=estimate.tree: em.speculative_generate(
            model, head, input_ids=ids, max_new_tokens=args.new_tokens, tree=tree, return_dict_in_generate=True)
    seconds, first, outs = timed(fns, args.runs, device)
    rows = {"model.generate": {"tokens_per_second": args.new_tokens / seconds["model.generate"],
                               "first_call_s": first["model.generate"]}}
    for name, estimate in estimates.items():
        tree, out = estimate.tree, outs[name]
        assert torch.equal(out.sequences, outs["model.generate"]), f"{name} tree {tree}: output differs from generate()"
        rows[name] = {"tree": [tree.depth, tree.top_k, tree.total_tokens],
                      "tokens_per_second": args.new_tokens / seconds[name], "first_call_s": first[name],
                      "predicted_tokens_per_second": estimate.tokens_per_second,
                      "accept_length": out.stats.mean_accept_length,
                      "predicted_accept_length": estimate.accept_length}
    print("\n| run | tree (D, k, N) | tok/s | predicted tok/s | accept length | predicted |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r.get('tree', '')} | {r['tokens_per_second']:.1f} | "
              f"{r.get('predicted_tokens_per_second', float('nan')):.1f} | {r.get('accept_length', 1.0):.2f} | "
              f"{r.get('predicted_accept_length', 1.0):.2f} |")
    report = {
        "device": torch.cuda.get_device_name() if args.cuda else "cpu", "torch": torch.__version__,
        "target": {**SHAPE_8B, "num_hidden_layers": args.layers} if args.cuda else "tests.tiny llama",
        "head": args.head, "strength": args.strength if args.head == "noisy" else None,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "calib_tokens": args.calib_tokens,
        "runs": rows, "calibration": result.as_dict(),
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
