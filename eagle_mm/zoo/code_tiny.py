"""Build ``code-tiny``: a small Python-code LM with its EAGLE and EAGLE-3 heads and an assistant, from nothing.

    python -m eagle_mm.zoo.code_tiny build --out DIR --seed 0 [--device cuda] [--toy] [--stage all|base|heads]
    python -m eagle_mm.zoo.code_tiny budget   # the size arithmetic of the real configuration

Stages: ``base`` = corpus (this interpreter's stdlib) -> byte-level BPE tokenizer -> target pre-training ->
2-layer assistant pre-training -> validation prompts; ``heads`` = draft-training rows from the train split (plus
the target's own greedy continuations) -> EAGLE head and EAGLE-3 head with ``eagle_mm.train``. ``all`` runs
both. Every stage merges what it measured into ``DIR/manifest.json``. Scratch files live in ``DIR/.work`` and
are deleted when a stage ends, so ``DIR`` holds exactly what ships (see docs/reference-models.md).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import logging
import math
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .corpus import Corpus, def_prompts, load_corpus
from .head_training import HeadTraining, text_rows, train_head, write_jsonl
from .pretrain import ModelShape, PretrainConfig, count_parameters, evaluate, pretrain, save_model, token_stream
from .tokenizer import EOT, load_tokenizer, train_tokenizer

__all__ = ["HeadTraining", "CodeTinyConfig", "real_config", "toy_config", "apply_overrides", "budget", "build",
           "merge_heads", "train_head",
           "main"]

logger = logging.getLogger(__name__)

NAME = "code-tiny"
MANIFEST = "manifest.json"
PROMPTS = "prompts.json"
PARTS = ("target", "assistant", "eagle", "eagle3")
_HEADS_FIELDS = ("heads", "generated_rows", "generated_tokens", "generate_batch_size")  # the configuration the heads stage reads
MB = 10**6


@dataclass
class CodeTinyConfig:
    """Everything a build depends on besides the interpreter and the seed."""

    vocab_size: int = 8192
    val_fraction: float = 0.02
    max_bytes: int | None = None  # corpus cap (toy builds)
    # ~2.7M training tokens (Python 3.11): an epoch is ~165 steps of 32 x 512 tokens, so the target (8.4M
    # parameters) sees ~9 epochs and keeps its best validation checkpoint. max_seconds guards a bounded machine.
    target: PretrainConfig = field(default_factory=lambda: PretrainConfig(max_seconds=300.0))
    assistant: PretrainConfig = field(default_factory=lambda: PretrainConfig(
        shape=ModelShape(hidden_size=192, intermediate_size=576, num_layers=2, num_heads=3, num_kv_heads=1),
        max_seconds=150.0))
    heads: HeadTraining = field(default_factory=HeadTraining)
    # The target's greedy continuations of train-split prompts, added to the heads' data: text exactly as the
    # target writes it, which is what a drafter is asked to predict at decode time.
    generated_rows: int = 4096
    generated_tokens: int = 256
    generate_batch_size: int = 1024
    prompts: int = 64  # validation prompts written to prompts.json
    context_lines: int = 12
    budget_bytes: int | None = 30 * MB  # everything shipped, tokenizer included
    max_shard_bytes: int = 14 * MB

    def with_seed(self, seed: int) -> "CodeTinyConfig":
        return dataclasses.replace(self, target=dataclasses.replace(self.target, seed=seed),
                                   assistant=dataclasses.replace(self.assistant, seed=seed + 1))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target"], d["assistant"] = self.target.to_dict(), self.assistant.to_dict()
        return json.loads(json.dumps(d))  # as manifest.json holds it (tuples become lists)


def real_config() -> CodeTinyConfig:
    """The shipped model's configuration (sized for the 30 MB budget; see ``budget``)."""
    return CodeTinyConfig()


def toy_config() -> CodeTinyConfig:
    """Everything tiny: the whole build runs on a CPU in seconds (tests/test_zoo.py)."""
    shape = ModelShape(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                       max_position_embeddings=512)
    small = dict(block_size=64, batch_size=8, warmup_steps=5, eval_every=15)
    return CodeTinyConfig(
        vocab_size=384, val_fraction=0.1, max_bytes=120_000,
        target=PretrainConfig(shape=shape, max_steps=30, lr=3e-3, **small),
        assistant=PretrainConfig(shape=dataclasses.replace(shape, num_layers=2, hidden_size=32, num_heads=2,
                                                           num_kv_heads=1), max_steps=10, lr=3e-3, **small),
        heads=HeadTraining(max_length=96, epochs=1, max_steps=12, batch_size=8, lr=3e-3, warmup_ratio=0.1,
                           eagle3_aux_layers=(1, 2, 4), eagle3_draft_vocab=256, ttt_steps=3, eval_samples=2, eval_max_new_tokens=8),
        generated_rows=4, generated_tokens=16, prompts=8, budget_bytes=None, max_shard_bytes=200_000)


# ---- sizes ---------------------------------------------------------------------------------------
def budget(config: CodeTinyConfig, *, tokenizer_bytes: int = 0) -> dict:
    """Parameters and bf16 bytes of every shipped model, built on the meta device (no memory, no weights)."""
    from transformers import LlamaForCausalLM

    from ..heads import Eagle3Head, EagleHead

    V = config.vocab_size
    sizes = {}
    with torch.device("meta"):
        models = {name: LlamaForCausalLM(getattr(config, name).shape.llama_config(
            V, eos_token_id=0, bos_token_id=0, pad_token_id=0)) for name in ("target", "assistant")}
        target = models["target"]
        heads = {"eagle": EagleHead.from_target(target),
                 "eagle3": Eagle3Head.from_target(target, draft_vocab_size=min(config.heads.eagle3_draft_vocab, V))}
    for name, model in models.items():
        n = count_parameters(model)
        sizes[name] = {"parameters": n, "bytes": 2 * n}  # a tied lm_head is stored once
    for name, head in heads.items():
        state = head.state_dict()  # floats saved in bf16; d2t (int64) and t2d (bool) keep their sizes
        sizes[name] = {"parameters": sum(t.numel() for t in state.values() if t.is_floating_point()),
                       "bytes": sum(t.numel() * (2 if t.is_floating_point() else t.element_size())
                                    for t in state.values())}
    total = sum(s["bytes"] for s in sizes.values()) + tokenizer_bytes
    return {"parts": sizes, "tokenizer_bytes": tokenizer_bytes, "total_bytes": total,
            "budget_bytes": config.budget_bytes}


def _check_budget(config: CodeTinyConfig, tokenizer_bytes: int = 0) -> dict:
    sizes = budget(config, tokenizer_bytes=tokenizer_bytes)
    if config.budget_bytes is not None and sizes["total_bytes"] > config.budget_bytes:
        parts = ", ".join(f"{k} {v['bytes'] / MB:.2f} MB" for k, v in sizes["parts"].items())
        raise ValueError(f"the configured models need {sizes['total_bytes'] / MB:.2f} MB ({parts}, tokenizer "
                         f"{tokenizer_bytes / MB:.2f} MB), over the {config.budget_bytes / MB:.0f} MB budget")
    return sizes


# ---- stages ----------------------------------------------------------------------------------------
def _device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _versions() -> dict:
    import tokenizers
    import transformers

    from .. import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "eagle_mm": __version__}


def _corpus(config: CodeTinyConfig) -> Corpus:
    return load_corpus(val_fraction=config.val_fraction, max_bytes=config.max_bytes)


def _pretrain_part(name: str, cfg: PretrainConfig, streams, tokenizer, out: Path, device, shard: int) -> dict:
    logger.info("pre-training the %s", name)
    result = pretrain(cfg, streams[0], streams[1], vocab_size=len(tokenizer), eot_id=tokenizer.eos_token_id,
                      device=device)
    save_model(result.model, out / name, max_shard_size=shard)
    if name == "target":
        tokenizer.save_pretrained(str(out / name))
    # The kept weights were evaluated in fp32 (bf16 autocast on CUDA); what ships is their bf16 copy.
    shipped = copy.deepcopy(result.model).to(torch.bfloat16)
    val_loss_bf16 = evaluate(shipped, streams[1], block_size=cfg.block_size, batch_size=max(1, cfg.batch_size // 2))
    return {"config": cfg.to_dict(), "parameters": count_parameters(result.model), **result.summary(),
            "val_loss_bf16": val_loss_bf16, "val_perplexity_bf16": math.exp(val_loss_bf16)}


def build_base(config: CodeTinyConfig, out: Path, device) -> dict:
    """Corpus -> tokenizer -> target -> assistant -> prompts.json; returns the manifest entries it measured."""
    corpus = _corpus(config)
    logger.info("corpus: %d train files, %d validation files", len(corpus.train), len(corpus.val))
    tick = time.perf_counter()
    tokenizer = train_tokenizer([d.text for d in corpus.train], vocab_size=config.vocab_size,
                                model_max_length=config.target.shape.max_position_embeddings)
    tokenizer_s = time.perf_counter() - tick
    streams = tuple(token_stream(tokenizer, [d.text for d in docs]) for docs in (corpus.train, corpus.val))
    val_bytes = sum(len(d.text.encode("utf-8")) for d in corpus.val)
    entries = {"corpus": {**corpus.summary(), "train_tokens": streams[0].numel(), "val_tokens": streams[1].numel()},
               "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": len(tokenizer), "special": EOT,
                             "seconds": round(tokenizer_s, 1)}}
    for name in ("target", "assistant"):
        entry = _pretrain_part(name, getattr(config, name), streams, tokenizer, out, device, config.max_shard_bytes)
        # Bits per byte: the tokenizer-independent form of the validation loss (EOT predictions included).
        entry["val_bits_per_byte"] = entry["val_loss"] * (streams[1].numel() - 1) / val_bytes / math.log(2)
        entries[name] = entry
    _write_prompts(config, corpus, out)
    return entries


def _write_prompts(config: CodeTinyConfig, corpus: Corpus, out: Path) -> None:
    prompts = def_prompts(corpus.val, config.prompts, context_lines=config.context_lines)
    (out / PROMPTS).write_text(json.dumps({"source": "validation split: the lines up to a def/class line's colon",
                                           "context_lines": config.context_lines, "prompts": prompts}, indent=1) + "\n",
                               encoding="utf-8")


@torch.no_grad()
def _generated_rows(config: CodeTinyConfig, target, tokenizer, corpus: Corpus, seed: int) -> list[dict]:
    """The target's greedy continuations of train-split prompts: text as the target writes it, for the heads."""
    if config.generated_rows == 0:
        return []
    prompts = def_prompts(corpus.train, config.generated_rows, context_lines=config.context_lines)
    device = target.get_input_embeddings().weight.device
    tokenizer.padding_side = "left"
    rows = []
    step = config.generate_batch_size
    for i in range(0, len(prompts), step):
        enc = tokenizer(prompts[i: i + step], return_tensors="pt", padding=True).to(device)
        out = target.generate(**enc, max_new_tokens=config.generated_tokens, do_sample=False)
        new = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        rows += [{"text": p + n} for p, n in zip(prompts[i: i + step], new)]
    return rows


def build_heads(config: CodeTinyConfig, out: Path, device, seed: int, corpus_sha: str | None,
                kinds: Sequence[str] = ("eagle", "eagle3")) -> dict:
    """Draft-training rows -> EAGLE head -> EAGLE-3 head (the target and tokenizer must be in ``out``)."""
    from transformers import AutoModelForCausalLM

    if not (out / "target" / "config.json").is_file():
        raise FileNotFoundError(f"{out / 'target'} holds no target; run the base stage first: python -m "
                                f"eagle_mm.zoo.code_tiny build --out {out} --stage base")
    corpus = _corpus(config)
    if corpus_sha is not None and corpus.digest() != corpus_sha:
        raise ValueError(f"this interpreter's corpus (sha256 {corpus.digest()[:12]}) is not the one the target in "
                         f"{out} was trained on ({corpus_sha[:12]}); run the heads stage with the same Python")
    _write_prompts(config, corpus, out)  # the heads are evaluated on these: written by the code that trains them
    tokenizer = load_tokenizer(out / "target")
    work = out / ".work"
    shutil.rmtree(work, ignore_errors=True)  # a crashed run's checkpoints would make the trainer refuse to start
    work.mkdir(parents=True)
    target = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32 if device.type == "cpu"
                                                  else torch.bfloat16, attn_implementation="sdpa").to(device).eval()
    tick = time.perf_counter()
    rows = text_rows(tokenizer, corpus.train, config.heads.max_length)
    generated = _generated_rows(config, target, tokenizer, corpus, seed)
    del target
    data = write_jsonl(work / "train.jsonl", rows + generated)
    eval_data = write_jsonl(work / "eval.jsonl", text_rows(tokenizer, corpus.val, config.heads.max_length))
    entries = {"head_data": {"text_rows": len(rows), "generated_rows": len(generated),
                             "generated_tokens": config.generated_tokens, "max_length": config.heads.max_length,
                             "seconds": round(time.perf_counter() - tick, 1)}}
    h = config.heads
    for kind in kinds:
        fields = dict(draft_vocab_size=min(h.eagle3_draft_vocab, len(tokenizer)),
                      aux_layers=h.eagle3_aux_layers) if kind == "eagle3" else {}
        entries[kind] = train_head(h, kind, kind, out, work, data, eval_data, seed, device, **fields)
    return entries


def _files(out: Path) -> dict:
    return {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*"))
            if p.is_file() and ".work" not in p.relative_to(out).parts and p.name != MANIFEST}


def apply_overrides(config: CodeTinyConfig, assignments: Sequence[str]) -> CodeTinyConfig:
    """A copy of ``config`` with ``field.sub=value`` assignments applied (value: JSON, else a plain string)."""
    config = copy.deepcopy(config)
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not of the form field.sub=value")
        *path, name = key.split(".")
        obj = config
        for part in path:
            obj = getattr(obj, part, None)
        if obj is None or not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
            raise ValueError(f"override {item!r}: {key!r} is not a configuration field (see manifest.json 'config')")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        setattr(obj, name, value)
        if hasattr(obj, "__post_init__"):  # validate the changed dataclass again
            obj.__post_init__()
    return config


def build(out, *, seed: int = 0, device: str | None = None, toy: bool = False, stage: str = "all",
          config: CodeTinyConfig | None = None, heads: Sequence[str] = ("eagle", "eagle3")) -> dict:
    """Build (a stage of) code-tiny into ``out``; returns the manifest, also written to ``out/manifest.json``."""
    if stage not in ("all", "base", "heads"):
        raise ValueError(f"stage must be all, base or heads; got {stage!r}")
    if not heads or any(k not in ("eagle", "eagle3") for k in heads):
        raise ValueError(f"heads must name eagle and/or eagle3; got {heads!r}")
    config = (config or (toy_config() if toy else real_config())).with_seed(seed)
    out, dev = Path(out).resolve(), _device(device)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8")) if (out / MANIFEST).is_file() else {}
    if stage in ("all", "base"):
        _check_budget(config)  # before any training, not after
        manifest = {}  # a new base invalidates every earlier part: start from an empty directory
        for name in (*PARTS, PROMPTS, MANIFEST, ".work"):
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    tick = time.perf_counter()
    if stage in ("all", "base"):
        manifest.update(build_base(config, out, dev))
    if stage in ("all", "heads"):
        manifest.update(build_heads(config, out, dev, seed, manifest.get("corpus", {}).get("sha256"), heads))
        shutil.rmtree(out / ".work", ignore_errors=True)
    files = _files(out)
    tokenizer_bytes = sum(size for path, size in files.items() if path.startswith("target/tokenizer"))
    manifest.update({
        "name": NAME, "toy": toy, "seed": seed, "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "build_command": f"python -m eagle_mm.zoo.code_tiny build --out DIR --seed {seed}" + (" --toy" if toy else ""),
        "budget": budget(config, tokenizer_bytes=tokenizer_bytes),
        "files": files, "total_bytes": sum(files.values()),
        "complete": all((out / p / "config.json").is_file() for p in PARTS),
    })
    if stage == "heads" and "config" in manifest:  # the base stage's settings stay as they were built
        manifest["config"].update({k: v for k, v in config.to_dict().items() if k in _HEADS_FIELDS})
    else:
        manifest["config"] = config.to_dict()
    manifest.setdefault("stage_seconds", {})[stage] = round(time.perf_counter() - tick, 1)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def merge_heads(out, other, kinds: Sequence[str]) -> dict:
    """Copy the ``kinds`` heads of build ``other`` (same base, heads trained in parallel) into build ``out``."""
    out, other = Path(out), Path(other)
    manifest, theirs = (json.loads((d / MANIFEST).read_text(encoding="utf-8")) for d in (out, other))
    if manifest.get("corpus", {}).get("sha256") != theirs.get("corpus", {}).get("sha256") or \
            manifest.get("target", {}).get("val_loss") != theirs.get("target", {}).get("val_loss"):
        raise ValueError(f"{other} was not built on the same base as {out}; merge only heads of one base build")
    for kind in kinds:
        shutil.rmtree(out / kind, ignore_errors=True)
        shutil.copytree(other / kind, out / kind)
        manifest[kind] = theirs[kind]
    files = _files(out)
    manifest.update(files=files, total_bytes=sum(files.values()),
                    complete=all((out / p / "config.json").is_file() for p in PARTS))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


# ---- command line ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_mm.zoo.code_tiny", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the models into --out")
    b.add_argument("--out", required=True, metavar="DIR")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default=None, help="pre-training device (default: cuda if available); the heads "
                                                   "train where accelerate puts them")
    b.add_argument("--toy", action="store_true", help="tiny everything: the whole build runs on a CPU in seconds")
    b.add_argument("--stage", choices=("all", "base", "heads"), default="all")
    b.add_argument("--heads", nargs="+", choices=("eagle", "eagle3"), default=["eagle", "eagle3"],
                   help="which draft heads the heads stage (re)trains; the others stay as built")
    b.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="override configuration fields, e.g. target.max_steps=800 heads.epochs=1 (recorded in "
                        "manifest.json)")
    m = sub.add_parser("merge", help="take heads trained in another copy of the same base build into --out")
    m.add_argument("--out", required=True, metavar="DIR")
    m.add_argument("--from", dest="other", required=True, metavar="DIR")
    m.add_argument("--heads", nargs="+", choices=("eagle", "eagle3"), required=True)
    sub.add_parser("budget", help="print the parameter and byte arithmetic of the real configuration")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    if args.command == "merge":
        manifest = merge_heads(args.out, args.other, args.heads)
        print(json.dumps({k: manifest[k].get("val_mean_accept_length") for k in args.heads}))
        return 0
    if args.command == "budget":
        print(json.dumps(budget(real_config()), indent=1))
        return 0
    config = apply_overrides(toy_config() if args.toy else real_config(), args.set)
    manifest = build(args.out, seed=args.seed, device=args.device, toy=args.toy, stage=args.stage, config=config,
                     heads=args.heads)
    keys = ("val_loss", "val_perplexity", "val_perplexity_bf16", "val_mean_accept_length", "stopped_early")
    summary = {part: {k: manifest[part][k] for k in keys if k in manifest[part]} for part in PARTS if part in manifest}
    print(json.dumps({"out": args.out, "total_bytes": manifest["total_bytes"], **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
