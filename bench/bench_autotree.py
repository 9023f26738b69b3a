"""Benchmark the chooser: the tree ``tree="auto"`` picks (acceptance calibrated by replay on a prompt), the default
call's (acceptance learned from the calls it watched), ``TreeConfig()`` and ``model.generate``, measured.

``choose_tree`` calibrates on a prompt and returns the chooser's decision with its finalists' expected rates; then
``speculative_generate`` decodes the same prompt with that tree, with the default call (``tree=None``) and with
``TreeConfig()``, and ``model.generate`` for reference, all in one process. Prints the decision and expected vs
measured tokens/s and accept lengths; --out writes JSON.

Target: a tiny random llama on CPU (default), or with --cuda a random-init target of Llama-3.1-8B's shape in bf16.
Head: --head noisy (default) proposes the target's own greedy continuation with noise (``bench.forced.NoisyHead``;
--strength sets its accuracy), so acceptance is realistic without a trained head; --head random is a fresh
EAGLE-3 head (almost nothing accepted: the chooser should pick no tree). Run from the repository root with the
package importable (pip install -e . or PYTHONPATH=.):

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

import eagle_mm as em
from bench.forced import NoisyHead
from bench.harness import timed_call
from bench.shapes import SHAPE_8B, random_8b_target


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="8B-shaped bf16 target on the GPU (else tiny llama on CPU)")
    p.add_argument("--layers", type=int, default=32, help="target layers with --cuda (fewer for a quick run)")
    p.add_argument("--head", choices=("noisy", "random"), default="noisy")
    p.add_argument("--strength", type=float, default=2.5, help="NoisyHead margin: higher = more accepted")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per measured run")
    p.add_argument("--runs", type=int, default=5, help="measured generations per method (median)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.cuda:
        model = random_8b_target(args.layers)
    else:  # a small llama, its output layer sharpened so that greedy choices are far from ties
        cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=96, max_position_embeddings=512, tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
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
    from eagle_mm.decode.autotree import choose_tree

    model = build(args)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    row = torch.randint(3, min(model.config.vocab_size, 1000), (1, args.prompt_len), generator=gen).to(device)
    ids = row.expand(args.batch, -1).contiguous()
    head = em.Eagle3Head.from_target(model).to(device=device, dtype=model.dtype)
    if args.head == "noisy":
        reference = model.generate(row, max_new_tokens=args.new_tokens + 64, do_sample=False)[0]
        head = NoisyHead(head, reference, args.strength)

    choice = choose_tree(model, head, row, decode=em.speculative_generate, batch_size=args.batch)
    print(choice)
    kw = dict(input_ids=ids, max_new_tokens=args.new_tokens, return_dict_in_generate=True)
    fns = {"model.generate": lambda: model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False),
           "auto": lambda: em.speculative_generate(model, head, tree=choice.tree, **kw),
           "default": lambda: em.speculative_generate(model, head, **kw),
           "TreeConfig()": lambda: em.speculative_generate(model, head, tree=em.TreeConfig(), **kw)}
    seconds, first, outs = timed(fns, args.runs, device)
    tokens = args.new_tokens * args.batch
    rows = {"model.generate": {"tokens_per_second": tokens / seconds["model.generate"],
                               "first_call_s": first["model.generate"]}}
    expected = {f.tree: f for f in choice.finalists}
    for name in ("auto", "default", "TreeConfig()"):
        out = outs[name]
        assert torch.equal(out.sequences, outs["model.generate"]), f"{name}: output differs from generate()"
        tree = out.stats.tree
        guess = expected.get(tree)
        rows[name] = {"tree": [tree.depth, tree.top_k, tree.total_tokens],
                      "tokens_per_second": tokens / seconds[name], "first_call_s": first[name],
                      "accept_length": out.stats.mean_accept_length,
                      "expected_tokens_per_second": args.batch * guess.tokens_per_second if guess else None,
                      "expected_accept_length": guess.accept_length if guess else None}
    print("\n| run | tree (D, k, N) | tok/s | expected tok/s | accept length | expected |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        exp_rate, exp_len = r.get("expected_tokens_per_second"), r.get("expected_accept_length")
        print(f"| {name} | {r.get('tree', '')} | {r['tokens_per_second']:.1f} | "
              f"{'-' if exp_rate is None else f'{exp_rate:.1f}'} | {r.get('accept_length', 1.0):.2f} | "
              f"{'-' if exp_len is None else f'{exp_len:.2f}'} |")
    report = {"device": torch.cuda.get_device_name() if args.cuda else "cpu", "torch": torch.__version__,
              "target": {**SHAPE_8B, "num_hidden_layers": args.layers} if args.cuda else "small llama",
              "head": args.head, "strength": args.strength if args.head == "noisy" else None,
              "prompt_len": args.prompt_len, "batch": args.batch, "new_tokens": args.new_tokens, "runs": rows,
              "choice": choice.as_dict()}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
