"""Benchmark EAGLE-3 training throughput on one CUDA GPU: the trainer's own step on an 8B-shaped target.

Builds a random-init target of Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocab 128256) in bf16, an EAGLE-3 head of the official 8B shape (draft vocab 32000,
fp32 master weights), and times full training steps on synthetic tokens: the frozen target's no-grad
forward with feature capture, the training-time-test loss unrolled K steps, backward, clipping and AdamW,
under accelerate's bf16 autocast (the path ``eagle_mm.train`` runs). Reports tokens/s (sequence tokens per
second; each passes through all K TTT steps), the share of time in the target forward, and peak GPU
memory, as JSON to --out. Run from the repository root with the package importable (pip install -e . or
PYTHONPATH=.):

    python bench/bench_train.py --out train.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.harness import sync
from bench.shapes import SHAPE_8B, random_8b_target



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=32, help="target layers (fewer for a quick smoke run)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def build(args):
    import eagle_mm as em

    target = random_8b_target(args.layers)
    cfg = target.config
    head = em.Eagle3Head.from_target(target, draft_vocab_size=args.draft_vocab).float()
    head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:args.draft_vocab])
    return target, head.train()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_train.py needs a CUDA GPU: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    from eagle_mm.train import TrainConfig
    from eagle_mm.train.accelerator import make_accelerator
    from eagle_mm.train.loop import HeadObjective
    from eagle_mm.train.target import target_features

    acc = make_accelerator("bf16")
    target, head = build(args)
    config = TrainConfig(target="unused", output_dir="unused", data="unused", ttt_steps=args.ttt_steps)
    objective = HeadObjective(head, config)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4, betas=(0.9, 0.95))
    objective, optimizer = acc.prepare(objective, optimizer)
    layers = head.feature_layers(args.layers)
    gen = torch.Generator().manual_seed(1)
    B, T = args.batch_size, args.seq_len
    t_target = t_total = 0.0
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, SHAPE_8B["vocab_size"], (B, T), generator=gen).cuda()
        attn = torch.ones_like(ids)
        sync()
        t0 = time.perf_counter()
        feats, last = target_features(target, layers, ids, attn, with_last=True)
        sync()
        t1 = time.perf_counter()
        batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": torch.ones_like(ids, dtype=torch.bool),
                 "features": feats, "last_hidden": last}
        loss, _ = objective(batch)
        acc.backward(loss)
        acc.clip_grad_norm_(objective.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if step >= args.warmup:
            t_target += t1 - t0
            t_total += t2 - t0
    tokens = B * T * args.steps
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "target": {**SHAPE_8B, "num_hidden_layers": args.layers, "dtype": "bfloat16"},
        "head": {"kind": "eagle3", "draft_vocab_size": args.draft_vocab, "master_dtype": "float32",
                 "parameters": sum(p.numel() for p in head.parameters())},
        "batch_size": B, "seq_len": T, "ttt_steps": args.ttt_steps, "timed_steps": args.steps,
        "tokens_per_s": tokens / t_total, "step_s": t_total / args.steps,
        "target_forward_share": t_target / t_total, "last_loss": float(loss.detach()),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
