"""EAGLE-3 drafter training on 1 and 2 GPUs: the trainer's throughput, its loss, its saved head.

The target is a random-init Llama-3.1-8B-shaped model in bf16, one copy per process, built straight on that
process's GPU (seeded, so every copy is the same) and handed to ``eagle_mm.train.train(config, target=...)``:
no 16 GB checkpoint is written or read. Everything else is the trainer's own path: tokenizer and data from
``--target`` / ``--data``, the draft vocabulary, accelerate (DDP over NCCL, bf16 autocast), the TTT loss, the
checkpoint and the exported head. The data are rows of the reference corpus (the Python standard library's
source) of exactly ``seq_len`` tokens each (code-tiny's tokenizer; its ids fit the 128k vocabulary), so a step
of P processes trains P * batch_size * seq_len tokens.

Three subcommands (run from the repository root with PYTHONPATH=.; dev/gpu/multi.sh runs them):

    python bench/bench_multi_gpu.py data PREP [--shape 8b --seq-len 2048 --steps 30 ...]
    python -m accelerate.commands.launch [--multi_gpu] --num_processes N --mixed_precision bf16 \\
        bench/bench_multi_gpu.py worker PREP RUN_DIR [--result FILE]
    python bench/bench_multi_gpu.py report OUT.json RESULT_1GPU.json RESULT_2GPU.json

``worker``'s main process writes --result (default RUN_DIR/result.json): tokens/s over the steady steps (the
first ``warmup`` steps and the last, which also writes the checkpoint, are not timed), the loss of every step,
peak memory, and whether ``Eagle3Head.from_pretrained(RUN_DIR/head)`` loads and drafts. ``report`` adds the
scaling efficiency: tokens/s on N GPUs / (N x tokens/s on 1). ``--shape tiny`` runs all of it on CPU in seconds.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from bench.shapes import SHAPE_8B

logger = logging.getLogger("bench_multi_gpu")

REPO = Path(__file__).resolve().parents[1]
CODE_TINY = REPO / "eagle_mm" / "zoo" / "models" / "code-tiny" / "target"

# Targets: Llama-3.1-8B, a ~0.5B model (hidden 1024, 16 layers, the 128k vocabulary) for the GPU + CPU split,
# and a tiny one for CPU test runs (its vocabulary still holds code-tiny's 8192 ids).
SHAPES = {
    "8b": SHAPE_8B,
    "small": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=4096, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=8192, rope_theta=500000.0, max_position_embeddings=2048),
}
# Training settings per shape: (seq_len, batch_size, steps, warmup, ttt_steps, draft_vocab, mixed_precision).
TRAIN = {
    "8b": dict(seq_len=2048, batch_size=1, steps=30, warmup=5, ttt_steps=7, draft_vocab=32000, mixed_precision="bf16"),
    "tiny": dict(seq_len=64, batch_size=2, steps=6, warmup=2, ttt_steps=3, draft_vocab=512, mixed_precision="no"),
}


def llama_config(shape: str):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_target(shape: str, device, dtype: torch.dtype, seed: int = 0):
    """A random-init Llama of ``shape``, built in ``dtype`` directly on ``device`` (no fp32 or host detour), frozen.

    Seeded: every process (and every device) that builds it gets the same weights.
    """
    from transformers import LlamaForCausalLM

    cfg = llama_config(shape)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    model.generation_config.bos_token_id = 0
    return model


def load_code_tokenizer(text_for_fallback: str | None = None):
    """code-tiny's tokenizer (8192 ids); if that model is not built here, a byte-level BPE trained on the text."""
    from eagle_mm.zoo.tokenizer import load_tokenizer, train_tokenizer

    if (CODE_TINY / "tokenizer.json").is_file():
        return load_tokenizer(CODE_TINY), "code-tiny"
    if text_for_fallback is None:
        raise FileNotFoundError(f"no tokenizer at {CODE_TINY} and no text to train one on")
    logger.warning("%s has no tokenizer; training an 8192-id byte-level BPE on the data instead", CODE_TINY)
    return train_tokenizer([text_for_fallback], vocab_size=8192), "bpe-8192-trained-here"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- data --------------------------------------------------------------------------------------------
def cmd_data(args) -> int:
    """PREP/target (config.json + tokenizer, no weights), PREP/rows.jsonl, PREP/prep.json."""
    from eagle_mm.train.data import write_rows
    from eagle_mm.zoo.corpus import load_corpus

    t0 = time.perf_counter()
    settings = {**TRAIN[args.shape], **{k: v for k, v in vars(args).items() if k in TRAIN["8b"] and v is not None}}
    seq, rows_needed = settings["seq_len"], settings["steps"] * settings["batch_size"] * args.max_processes
    window = seq + 16  # decoded and re-encoded, a window may lose a token or two at its edges; truncation evens it
    corpus = load_corpus(max_bytes=max(rows_needed * window * 8, 100_000))
    text = "\n".join(d.text for d in corpus.train)
    tokenizer, tok_name = load_code_tokenizer(text)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < rows_needed * window:
        raise ValueError(f"the corpus sample has {len(ids)} tokens; {rows_needed} rows of {window} need "
                         f"{rows_needed * window}")
    rows = []
    for r in range(len(ids) // window):
        piece = tokenizer.decode(ids[r * window:(r + 1) * window])
        if len(tokenizer(piece, add_special_tokens=True).input_ids) >= seq:  # the trainer cuts it to seq exactly
            rows.append({"text": piece})
        if len(rows) == rows_needed:
            break
    if len(rows) < rows_needed:
        raise ValueError(f"only {len(rows)} corpus rows reach {seq} tokens; {rows_needed} are needed")
    prep = Path(args.prep)
    (prep / "target").mkdir(parents=True, exist_ok=True)
    llama_config(args.shape).save_pretrained(prep / "target")
    tokenizer.save_pretrained(prep / "target")
    write_rows(prep / "rows.jsonl", rows)
    info = {"shape": args.shape, **settings, "lr": args.lr, "rows": len(rows), "tokenizer": tok_name,
            "corpus": corpus.summary() | {"train_files_used": len(corpus.train)},
            "target_dir": str(prep / "target"), "data": str(prep / "rows.jsonl"),
            "prepare_s": round(time.perf_counter() - t0, 2)}
    (prep / "prep.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    logger.info("wrote %d rows of %d tokens to %s in %.1f s", len(rows), seq, prep, info["prepare_s"])
    return 0


# ---- one launched process ----------------------------------------------------------------------------
def cmd_worker(args) -> int:
    """Run under accelerate launch: train, time the steps, then (main process) check the saved head."""
    from eagle_mm.train import TrainConfig
    from eagle_mm.train.loop import train

    prep = json.loads((Path(args.prep) / "prep.json").read_text(encoding="utf-8"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / f"pid.{rank}").write_text(str(os.getpid()))  # for the launching script to clean up after a timeout
    t0 = time.perf_counter()
    target = build_target(prep["shape"], device, torch.bfloat16 if cuda else torch.float32)
    _sync(device)
    build_s = time.perf_counter() - t0
    config = TrainConfig(
        target=prep["target_dir"], data=prep["data"], output_dir=str(run / "head"), kind="eagle3",
        max_length=prep["seq_len"], batch_size=prep["batch_size"], max_steps=prep["steps"],
        ttt_steps=prep["ttt_steps"], draft_vocab_size=prep["draft_vocab"], lr=prep["lr"],
        mixed_precision=prep["mixed_precision"] if cuda else "no", save_every=prep["steps"], keep_checkpoints=1,
        log_every=1, eval_holdout=0, seed=0)
    stamps: list[tuple[int, float, float]] = []  # (step, time after it, loss)
    out = Path(args.result or run / "result.json")
    info = {"processes": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "transformers": _version("transformers"), "accelerate": _version("accelerate"),
            "target": {**SHAPES[prep["shape"]], "dtype": "bfloat16" if cuda else "float32", "init": "random, seed 0"},
            "build_target_s": round(build_s, 2)}

    def on_step(step: int, metrics: dict) -> None:
        _sync(device)  # the metrics' all-reduce already waited on the step; this makes it explicit
        stamps.append((step, time.perf_counter(), metrics["loss"]))
        if rank == 0:
            logger.info("step %d loss %.4f", step, metrics["loss"])
            if step == prep["steps"] - 1:  # the timed steps are done: keep them should the checkpoint time out
                _write(out, _timing(prep, stamps, world) | info | {"partial": "before the last step and checkpoint"})

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t1 = time.perf_counter()
    train(config, on_step=on_step, target=target)
    train_s = time.perf_counter() - t1
    if rank != 0:
        return 0
    result = _timing(prep, stamps, world) | info | {
        "train_call_s": round(train_s, 2),
        "peak_memory_gib_rank0": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "head": _check_head(run / "head", target, prep),
    }
    _write(out, result)
    logger.info("result: %s", json.dumps({k: result[k] for k in ("tokens_per_s", "loss_first", "loss_last")}))
    return 0


def _write(path: Path, result: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _timing(prep: dict, stamps: list, world: int) -> dict:
    """Tokens/s over steps warmup+1 .. steps-1: the last step also writes the checkpoint, so it is left out."""
    steps, warmup = prep["steps"], prep["warmup"]
    per_step = world * prep["batch_size"] * prep["seq_len"]
    times = {s: t for s, t, _ in stamps}
    losses = [loss for _, _, loss in stamps]
    timed = steps - 1 - warmup
    span = times[steps - 1] - times[warmup]
    k = max(1, min(3, len(losses) // 2))
    return {
        "steps": steps, "warmup_steps": warmup, "timed_steps": timed, "seq_len": prep["seq_len"],
        "batch_size_per_process": prep["batch_size"], "ttt_steps": prep["ttt_steps"],
        "draft_vocab_size": prep["draft_vocab"], "tokens_per_step": per_step,
        "tokens_per_s": per_step * timed / span, "step_s": span / timed,
        "losses": losses, "loss_first": losses[0], "loss_last": losses[-1],
        "loss_falls": sum(losses[-k:]) / k < sum(losses[:k]) / k,
    }


def _check_head(path: Path, target, prep: dict) -> dict:
    """Load the exported head with Eagle3Head.from_pretrained and let it draft a short speculative generation."""
    import eagle_mm as em

    try:
        head = em.Eagle3Head.from_pretrained(path, target=target, dtype=target.dtype)  # saved bf16; fp32 on CPU
        ids = torch.randint(3, 8192, (1, 16), generator=torch.Generator().manual_seed(0)).to(target.device)
        out = em.speculative_generate(target, head, input_ids=ids, max_new_tokens=16, do_sample=False,
                                      return_dict_in_generate=True)
        return {"loads": True, "kind": type(head).__name__, "aux_layers": list(head.config.aux_layers),
                "draft_vocab_size": head.config.draft_vocab_size, "dtype": str(next(head.parameters()).dtype),
                "parameters": sum(p.numel() for p in head.parameters()),
                "mean_accept_length": out.stats.mean_accept_length}
    except Exception as e:  # reported, not raised: the throughput figures above stand on their own
        logger.exception("the saved head did not load or draft")
        return {"loads": False, "error": f"{type(e).__name__}: {e}"}


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


# ---- report -------------------------------------------------------------------------------------------
def cmd_report(args) -> int:
    runs = {}
    for f in map(Path, args.results):
        if f.is_file():
            r = json.loads(f.read_text(encoding="utf-8"))
            runs[r["processes"]] = r
        else:
            logger.warning("%s is missing (that run failed or timed out)", f)
    out = {"runs": {str(n): {k: v for k, v in r.items() if k != "losses"} | {"losses": r["losses"]}
                    for n, r in sorted(runs.items())}}
    if 1 in runs:
        for n, r in runs.items():
            if n > 1:
                out[f"scaling_efficiency_{n}"] = r["tokens_per_s"] / (n * runs[1]["tokens_per_s"])
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    for n, r in sorted(runs.items()):
        print(f"{n} process(es): {r['tokens_per_s']:,.0f} tokens/s, {r['step_s']:.3f} s/step, loss "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} (falls: {r['loss_falls']}), head loads: "
              f"{r.get('head', {}).get('loads')}{' (partial: ' + r['partial'] + ')' if 'partial' in r else ''}")
    for k, v in out.items():
        if k.startswith("scaling"):
            print(f"{k}: {v:.3f}")
    return 0 if runs else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="target dir (config + tokenizer) and corpus rows")
    d.add_argument("prep")
    d.add_argument("--shape", choices=sorted(TRAIN), default="8b")
    d.add_argument("--tiny", dest="shape", action="store_const", const="tiny", help="--shape tiny: a CPU test run")
    d.add_argument("--max-processes", type=int, default=2, help="the most processes a run will use")
    for name in ("seq_len", "batch_size", "steps", "warmup", "ttt_steps", "draft_vocab"):
        d.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    d.add_argument("--mixed-precision", dest="mixed_precision", default=None)
    d.add_argument("--lr", type=float, default=2e-4)
    w = sub.add_parser("worker", help="one process of an accelerate launch")
    w.add_argument("prep")
    w.add_argument("run_dir", help="output folder of the run: the head, its checkpoint, logs")
    w.add_argument("--result", default=None,
                   help="where the main process writes its JSON (default RUN_DIR/result.json)")
    r = sub.add_parser("report", help="merge the runs' results")
    r.add_argument("out")
    r.add_argument("results", nargs="+", help="the workers' result JSON files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    return {"data": cmd_data, "worker": cmd_worker, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
