"""Build ``scenes-tiny``: a small LLaVA-style VLM trained from scratch on procedural scenes, with three EAGLE-3 heads.

    python -m eagle_mm.zoo.scenes_tiny build --out DIR --seed 0 [--device cuda] [--toy] [--stage all|base|heads]

Stages: ``base`` = scene texts -> byte-level BPE tokenizer (+ ``<image>``) -> processor -> LLaVA (CLIP vision tower,
Llama language model) trained on training-split scenes -> greedy accuracy per task on validation scenes, saved to
``DIR/target``; ``heads`` = the VLM's own answers to training-split questions (pictures written to ``DIR/.work``)
-> the image-aware EAGLE-3 head (``DIR/eagle3``: at image positions it reads the merged image embeddings), the
ablation (``DIR/eagle3-noimage``: ``image_embeds=False``, the placeholder token's embedding there) and the stricter
ablation (``DIR/eagle3-blind``: also ``image_features=False``, zeros for the target's features there: the draft sees
nothing of the image's positions), all with ``eagle_mm.train``. Each stage saves as it ends and merges what it
measured into ``DIR/manifest.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import random
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import scenes_data as sd
from .code_tiny import _device, _files, _versions, apply_overrides
from .head_training import HeadTraining, train_head
from .scenes_vlm import (VLMShape, VLMTraining, evaluate_tasks, make_model, make_processor, pretrain_vlm,
                         render_pool, train_tokenizer)

__all__ = ["ScenesTinyConfig", "real_config", "toy_config", "build", "image_demo", "HEADS", "main"]

logger = logging.getLogger(__name__)

NAME = "scenes-tiny"
MANIFEST = "manifest.json"
# directory -> the head's image flags (DraftHeadConfig.image_embeds / image_features; absent: True)
HEADS = {"eagle3": {}, "eagle3-noimage": {"image_embeds": False},
         "eagle3-blind": {"image_embeds": False, "image_features": False}}
PARTS = ("target", *HEADS)
MB = 10**6


@dataclass
class ScenesTinyConfig:
    """Everything a build depends on besides the seed."""

    vocab_size: int = 1024  # a cap: the scene texts need fewer merges
    tokenizer_scenes: int = 4000  # training scenes whose questions and answers train the tokenizer
    shape: VLMShape = field(default_factory=VLMShape)
    training: VLMTraining = field(default_factory=VLMTraining)
    eval_examples: int = 600  # validation examples answered greedily for the per-task accuracy
    heads: HeadTraining = field(default_factory=lambda: HeadTraining(
        max_length=256, epochs=2, batch_size=32, lr=1e-3, warmup_ratio=0.05, eagle3_draft_vocab=1024, ttt_steps=6,
        eval_samples=8, eval_max_new_tokens=64))
    aux_layers: tuple[int, int, int] | None = (2, 3, 5)  # low, middle, high (6 layers)
    # The VLM's answers to training questions, the heads' data: with 2400 rows x 3 epochs the three heads tied
    # (docs/benchmarks.md); 12000 x 2 is where the image-aware head pulled ahead of the ablations.
    head_rows: int = 12000
    head_caption_share: float = 0.5
    max_new_tokens: int = 96  # longest answer (a 6-shape caption is ~75 tokens)
    budget_bytes: int | None = 20 * MB
    max_shard_bytes: int = 14 * MB

    def __post_init__(self) -> None:
        if isinstance(self.shape, dict):
            self.shape = VLMShape(**self.shape)
        if isinstance(self.training, dict):
            self.training = VLMTraining(**self.training)
        if isinstance(self.heads, dict):
            self.heads = HeadTraining(**self.heads)

    def with_seed(self, seed: int) -> "ScenesTinyConfig":
        return dataclasses.replace(self, training=dataclasses.replace(self.training, seed=seed))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def real_config() -> ScenesTinyConfig:
    """The shipped model's configuration: ~6.5M-parameter VLM; on one H200 the base stage takes ~6 minutes and
    the heads stage ~5 (two calls of the lent GPU: ``--stage base``, then ``--stage heads``)."""
    return ScenesTinyConfig()


def toy_config() -> ScenesTinyConfig:
    """Everything tiny: the whole build runs on a CPU in seconds (tests/test_scenes_tiny.py)."""
    shape = VLMShape(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     vision_hidden_size=32, vision_intermediate_size=64, vision_layers=1, vision_heads=2,
                     image_size=48, patch_size=16)
    return ScenesTinyConfig(
        vocab_size=400, tokenizer_scenes=200, shape=shape, eval_examples=12, aux_layers=(1, 2, 3),
        training=VLMTraining(scenes=64, batch_size=8, max_steps=20, max_seconds=None, lr=3e-3, log_every=10,
                             workers=1),
        heads=HeadTraining(max_length=160, epochs=1, max_steps=6, batch_size=4, lr=3e-3, warmup_ratio=0.1,
                           eagle3_draft_vocab=256, ttt_steps=3, eval_samples=2, eval_max_new_tokens=8),
        head_rows=12, max_new_tokens=24, budget_bytes=None, max_shard_bytes=2 * MB)


# ---- stages -------------------------------------------------------------------------------------------------
def _train_seeds(n: int, offset: int = 0) -> list[int]:
    return list(range(sd.TRAIN_SEEDS.start + offset, sd.TRAIN_SEEDS.start + offset + n))


def build_base(config: ScenesTinyConfig, out: Path, device: torch.device) -> dict:
    """Tokenizer -> processor -> VLM trained on training scenes -> per-task validation accuracy; saves target/."""
    tick = time.perf_counter()  # rendering first: its worker processes fork before CUDA or tokenizer threads start
    pool = render_pool(_train_seeds(config.training.scenes), config.shape.image_size, config.training.workers)
    entries = {"scenes": {"train_scenes": len(pool.qa), "image_size": config.shape.image_size,
                          "seconds": round(time.perf_counter() - tick, 1)}}
    logger.info("rendered %d training scenes in %.1f s", len(pool.qa), entries["scenes"]["seconds"])
    tick = time.perf_counter()
    texts = [t for s in _train_seeds(config.tokenizer_scenes) for _, q, a in sd.qa_pairs(sd.make_scene(s))
             for t in (q, a)]
    tokenizer = train_tokenizer(texts, config.vocab_size)
    processor = make_processor(tokenizer, config.shape)
    entries["tokenizer"] = {"kind": "byte-level BPE (tokenizers)", "vocab_size": len(tokenizer),
                            "seconds": round(time.perf_counter() - tick, 1)}
    torch.manual_seed(config.training.seed)
    model = make_model(config.shape, tokenizer)
    entries["target"] = {"parameters": sum(p.numel() for p in model.parameters()),
                         "image_tokens": config.shape.image_tokens,
                         "training": pretrain_vlm(model, tokenizer, pool, config.training, device)}
    del pool
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    save_target(model, processor, out / "target", config.max_shard_bytes)
    # Graded on the weights as shipped: bf16 on a GPU.
    entries["target"]["validation"] = evaluate_tasks(model, tokenizer, config.eval_examples, config.shape.image_size,
                                                     max_new_tokens=config.max_new_tokens)
    logger.info("validation accuracy: %s", entries["target"]["validation"]["accuracy"])
    return entries


def save_target(model, processor, path: Path, max_shard_bytes: int) -> None:
    import copy

    copy.deepcopy(model).to("cpu", torch.bfloat16).save_pretrained(str(path), max_shard_size=max_shard_bytes)
    processor.save_pretrained(str(path))


def _head_rows(config: ScenesTinyConfig, out: Path, work: Path, device: torch.device) -> tuple[str, str, dict]:
    """JSON-lines chat rows with pictures: the VLM's greedy answers to training questions, and validation prompts."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from .scenes_vlm import answer

    tick = time.perf_counter()
    model = LlavaForConditionalGeneration.from_pretrained(
        str(out / "target"), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoProcessor.from_pretrained(str(out / "target")).tokenizer
    # Seeds after the VLM's own pool: scenes it never saw, answered as it answers them.
    # One process: CUDA is up by now (no fork), and a few thousand scenes take a second or two.
    pool = render_pool(_train_seeds(config.head_rows, offset=config.training.scenes), config.shape.image_size, 1)
    rng = random.Random(f"{config.training.seed}/heads")
    picked = []
    for qa in pool.qa:
        if rng.random() < config.head_caption_share:
            picked.append(qa[0])
        else:
            tasks = sorted({t for t, _, _ in qa})
            task = rng.choice(tasks)
            picked.append(rng.choice([x for x in qa if x[0] == task]))
    replies = answer(model, tokenizer, pool.images, [q for _, q, _ in picked], max_new_tokens=config.max_new_tokens)
    (work / "images").mkdir(parents=True, exist_ok=True)
    from PIL import Image

    rows = []
    for i, ((task, q, _), reply) in enumerate(zip(picked, replies)):
        rel = f"images/{i:06d}.png"
        Image.fromarray(pool.images[i].numpy()).save(work / rel)
        rows.append({"images": [rel], "task": task, "messages": [
            {"role": "user", "content": [{"type": "text", "text": q}, {"type": "image"}]},
            {"role": "assistant", "content": reply}]})
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    val = []
    for i, ex in enumerate(sd.examples("validation", max(config.heads.eval_samples, 1), size=config.shape.image_size,
                                       tasks=["caption"])):
        rel = f"images/val-{i:04d}.png"
        ex["image"].save(work / rel)
        val.append({"images": [rel], "messages": [
            {"role": "user", "content": [{"type": "text", "text": ex["prompt"]}, {"type": "image"}]},
            {"role": "assistant", "content": ex["answer"]}]})
    eval_data = work / "eval.jsonl"
    eval_data.write_text("".join(json.dumps(r) + "\n" for r in val), encoding="utf-8")
    return str(data), str(eval_data), {"rows": len(rows), "seconds": round(time.perf_counter() - tick, 1)}


def _train_head(name: str, flags: dict, config: ScenesTinyConfig, out: Path, work: Path, data: str,
                eval_data: str, seed: int, device: torch.device) -> dict:
    from .tokenizer import load_tokenizer

    h = config.heads
    vocab = len(load_tokenizer(out / "target"))
    flags = {"image_embeds": True, "image_features": True, **flags}
    entry = train_head(h, "eagle3", name, out, work, data, eval_data, seed, device, **flags,
                       draft_vocab_size=min(h.eagle3_draft_vocab, vocab), aux_layers=config.aux_layers)
    return {**flags, **entry}


def build_heads(config: ScenesTinyConfig, out: Path, device: torch.device, seed: int,
                manifest: dict | None = None, manifest_path: Path | None = None) -> dict:
    """The heads' data, then the image-aware head and the two ablations; each saved (and recorded) as it ends."""
    if not (out / "target" / "config.json").is_file():
        raise FileNotFoundError(f"{out / 'target'} holds no VLM; run the base stage first: python -m "
                                f"eagle_mm.zoo.scenes_tiny build --out {out} --stage base")
    work = out / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data, eval_data, info = _head_rows(config, out, work, device)
    entries = {"head_data": info}
    for name, flags in HEADS.items():
        entries[name] = _train_head(name, flags, config, out, work, data, eval_data, seed, device)
        if manifest is not None and manifest_path is not None:
            _write_manifest(out, manifest | entries, manifest_path)
    return entries


def _write_manifest(out: Path, manifest: dict, path: Path) -> None:
    files = _files(out)
    manifest = manifest | {"files": files, "total_bytes": sum(files.values()),
                           "complete": all((out / p / "config.json").is_file() for p in PARTS)}
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _stage_done(manifest: dict, stage: str, tick: float, dev: torch.device) -> None:
    """Record how long ``stage`` took, and where and with what it ran (a heads-only rebuild may run elsewhere)."""
    for key, value in (("stage_seconds", round(time.perf_counter() - tick, 1)), ("stage_devices", str(dev)),
                       ("stage_versions", manifest["versions"])):
        manifest.setdefault(key, {})[stage] = value


def build(out, *, seed: int = 0, device: str | None = None, toy: bool = False, stage: str = "all",
          config: ScenesTinyConfig | None = None) -> dict:
    """Build (a stage of) scenes-tiny into ``out``; returns the manifest, also written to ``out/manifest.json``."""
    if stage not in ("all", "base", "heads"):
        raise ValueError(f"stage must be all, base or heads; got {stage!r}")
    config = (config or (toy_config() if toy else real_config())).with_seed(seed)
    out, dev = Path(out).resolve(), _device(device)
    out.mkdir(parents=True, exist_ok=True)
    path = out / MANIFEST
    manifest = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if stage in ("all", "base"):
        manifest = {}
        for name in (*PARTS, MANIFEST, ".work"):
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    manifest.update({
        "name": NAME, "toy": toy, "seed": seed, "device": str(dev),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "versions": _versions(),
        "build_command": f"python -m eagle_mm.zoo.scenes_tiny build --out DIR --seed {seed}" + " --toy" * toy,
        "config": config.to_dict()})
    tick = time.perf_counter()
    if stage in ("all", "base"):
        manifest.update(build_base(config, out, dev))
        manifest["gpu"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None  # CUDA is up now
        _stage_done(manifest, "base", tick, dev)
        _write_manifest(out, manifest, path)  # the VLM is kept even if the heads never finish
    if stage in ("all", "heads"):
        tick = time.perf_counter()
        manifest.update(build_heads(config, out, dev, seed, manifest, path))
        _stage_done(manifest, "heads", tick, dev)
        shutil.rmtree(out / ".work", ignore_errors=True)
    _write_manifest(out, manifest, path)
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if config.budget_bytes is not None and manifest["total_bytes"] > config.budget_bytes:
        logger.warning("the build is %.2f MB, over its %.0f MB budget", manifest["total_bytes"] / MB,
                       config.budget_bytes / MB)
    return manifest


# ---- demo ---------------------------------------------------------------------------------------------------
def image_demo(image=None, question: str = "Describe the image.", *, path=None, device=None, tree=None,
               max_new_tokens: int = 96, seed: int = 0, runs: int = 3) -> dict:
    """Speculative decoding on scenes-tiny next to ``generate``, on ``image`` (a path or PIL image; default:
    validation scene ``seed`` rendered). ``path``: a build directory (default: ``eagle_mm.zoo.load``'s). tree:
    None drafts the default call's tree. runs: timed runs of each decoding, alternating.

    Returns {question, completion, identical, mean_accept_length, accept_rate_per_position, generate_s,
    speculative_s (the median times), speedup (the median), speedups (one per run), tree}; the completion is the
    speculative one (greedy: the same as generate's).
    """
    from PIL import Image

    from ..decode.loop import speculative_generate
    from .registry import load, load_scenes_dir

    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be a positive int (timed runs of each decoding), got {runs!r}")
    zm = load_scenes_dir(path, device=device) if path is not None else load(NAME, device=device)
    if image is None:
        image = sd.render(sd.make_scene(seed), zm.image_size)
    elif not isinstance(image, Image.Image):
        with Image.open(image) as im:
            image = im.convert("RGB")
    inputs = zm.inputs(image.convert("RGB"), question)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    times = []
    with torch.no_grad():
        zm.target.generate(**inputs, **kw)  # warm-up: the first call pays one-time costs
        speculative_generate(zm.target, zm.head, **inputs, tree=tree, **kw)
        for _ in range(runs):
            t0 = _now(zm.target)
            ref = zm.target.generate(**inputs, **kw)
            t1 = _now(zm.target)
            out = speculative_generate(zm.target, zm.head, **inputs, tree=tree, return_dict_in_generate=True, **kw)
            times.append((t1 - t0, _now(zm.target) - t1))
    n = inputs["input_ids"].shape[1]
    stats = out.stats
    speedups = [g / max(s, 1e-9) for g, s in times]
    return {"question": question, "completion": zm.processor.tokenizer.decode(out.sequences[0, n:],
                                                                               skip_special_tokens=True),
            "identical": bool(torch.equal(out.sequences, ref)), "mean_accept_length": stats.mean_accept_length,
            "accept_rate_per_position": stats.accept_rate_per_position,
            "generate_s": statistics.median([g for g, _ in times]),
            "speculative_s": statistics.median([s for _, s in times]),
            "speedup": statistics.median(speedups), "speedups": speedups, "tree": dataclasses.asdict(stats.tree)}


def _now(model) -> float:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter()


# ---- command line -------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_mm.zoo.scenes_tiny", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the VLM and its heads into --out")
    b.add_argument("--out", required=True, metavar="DIR")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default=None, help="default: cuda if available")
    b.add_argument("--toy", action="store_true", help="tiny everything: the whole build runs on a CPU in seconds")
    b.add_argument("--stage", choices=("all", "base", "heads"), default="all")
    b.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="override configuration fields, e.g. training.max_seconds=100 heads.epochs=2")
    d = sub.add_parser("demo", help="speculative decoding next to generate on one scene")
    d.add_argument("--image", default=None, help="a picture (default: a rendered validation scene)")
    d.add_argument("--question", default="Describe the image.")
    d.add_argument("--path", default=None, help="a build directory (default: the zoo's scenes-tiny)")
    d.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    if args.command == "demo":
        print(json.dumps(image_demo(args.image, args.question, path=args.path, device=args.device), indent=1))
        return 0
    config = apply_overrides(toy_config() if args.toy else real_config(), args.set)
    manifest = build(args.out, seed=args.seed, device=args.device, toy=args.toy, stage=args.stage, config=config)
    summary = {"out": args.out, "total_bytes": manifest["total_bytes"], "complete": manifest["complete"],
               "accuracy": manifest.get("target", {}).get("validation", {}).get("accuracy")}
    summary |= {h: manifest[h].get("val_mean_accept_length") for h in HEADS if h in manifest}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
