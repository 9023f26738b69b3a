"""The training loop: accelerate (DDP/FSDP, mixed precision), accumulation, clipping, cosine schedule,
atomic checkpoints with exact resume, and the final acceptance-length evaluation.

The target is frozen and stays outside ``accelerator.prepare``: it is run under ``no_grad`` (online
features) or not at all (features dumped by ``dump.py``). Only the head and its loss, wrapped in one
module so that DDP and FSDP see an ordinary forward, are prepared.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..hf.parts import resolve_target
from ..heads import Eagle3Head, EagleHead
from ..heads.io import load_head
from ..hf.multimodal import hide_image_features
from .accelerator import make_accelerator
from .checkpoint import check_resumable, list_checkpoints, resolve_resume, save_checkpoint
from .config import VARIANTS, TrainConfig
from .data import BatchPlan, build_draft_vocab, collate, encode_rows, has_images, read_rows, write_rows
from .dump import FeatureStore, feature_layers
from .evaluate import eval_prompts, evaluate
from .regenerate import regenerate_rows
from .schedule import Pace, Schedule
from .losses import eagle1_loss, eagle3_loss
from .target import load_processor, load_target, load_target_embeddings, load_tokenizer, target_features

__all__ = ["train", "TrainResult", "HeadObjective"]

logger = logging.getLogger(__name__)

LOG_NAME = "train_log.jsonl"
EVAL_NAME = "eval.json"
REGENERATED_NAME = "regenerated.jsonl"


@dataclass
class TrainResult:
    output_dir: Path
    step: int  # optimizer steps done in total
    losses: list[float] = field(default_factory=list)  # this run's steps, in order
    accuracies: list[list[float]] = field(default_factory=list)  # per step: top-1 accuracy of each TTT step
    mean_accept_length: float | None = None


class HeadObjective(nn.Module):
    """The head and its loss as one module: ``forward(batch) -> (loss, stats)``."""

    def __init__(self, head, config: TrainConfig):
        super().__init__()
        self.head, self.config = head, config

    def forward(self, batch: dict):
        c = self.config
        if c.kind == "eagle3":
            return eagle3_loss(self.head, batch, steps=c.ttt_steps, decay=c.ttt_decay)
        return eagle1_loss(self.head, batch, noise=c.feature_noise, p_weight=c.p_weight, v_weight=c.v_weight)


def _said_when_out_of_space(fn):
    @functools.wraps(fn)
    def run(config: TrainConfig, **kwargs):
        with _out_of_space(config):
            return fn(config, **kwargs)

    return run


@_said_when_out_of_space  # a full disk anywhere in the run: one line saying what is kept and how to go on
def train(config: TrainConfig, *, on_step=None, processor=None, target=None) -> TrainResult:
    """Train a draft head as ``config`` says; ``on_step(step, metrics)`` is called after every optimizer step.

    ``processor``: the target's HF processor, for rows with images (default: ``AutoProcessor`` from
    ``config.target``, loaded only when some row has images). ``target``: the target model, already on this
    process's device, instead of loading the weights from ``config.target`` (which still provides the tokenizer).

    The head is written to ``config.output_dir`` (``from_pretrained`` loads it). Run under ``accelerate launch``
    for several processes. Refuses, before writing anything, to resume a checkpoint of a different run.
    """
    from accelerate.utils import set_seed

    resume_dir = resolve_resume(config)
    acc = make_accelerator(config.mixed_precision)
    start = check_resumable(resume_dir, config, acc.num_processes)["step"] if resume_dir else 0
    if config.max_seconds is not None and acc.num_processes > 1:
        raise ValueError(f"max_seconds={config.max_seconds} needs one process: each of the {acc.num_processes} "
                         f"would measure its own pace and stop at its own step; use max_steps")
    if config.target_device_map is not None and acc.num_processes > 1:
        raise ValueError(f"target_device_map={config.target_device_map!r} cannot be combined with "
                         f"{acc.num_processes} processes: each process holds its own target")
    target, examples, held_out = _load(config, acc, processor, target)  # bad data fails here, before any write
    out = Path(config.output_dir)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        config.save(out / "train_config.json")
    parts = resolve_target(target)
    set_seed(config.seed)  # here, so the head's initial weights do not depend on how the target was loaded
    head = _build_head(config, target, examples)
    objective = HeadObjective(head, config)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=config.adam_betas,
                                  weight_decay=config.weight_decay)
    plan = BatchPlan(len(examples), config.batch_size, acc.num_processes, config.grad_accum, config.seed)
    plan.check()
    total = config.max_steps or plan.steps_per_epoch * config.epochs
    schedule = Schedule(total, config.warmup_ratio, config.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    objective, optimizer = acc.prepare(objective, optimizer)
    # Not prepared: accelerate would step a prepared scheduler once per process; ours counts optimizer steps.
    acc.register_for_checkpointing(scheduler)
    _resume(acc, resume_dir, start, out / LOG_NAME)

    layers = feature_layers(config, parts.num_layers)
    result = TrainResult(out, start)
    with _logs_above_bars():
        _loop(config, acc, objective, optimizer, scheduler, plan, examples, target, layers, start, total, on_step,
              result)
    _export_head(acc, objective, out, config.save_dtype)
    if held_out and config.eval_samples:
        with _logs_above_bars():
            result.mean_accept_length = _evaluate(config, acc, target, held_out)
    acc.wait_for_everyone()
    acc.end_training()
    return result


def _logs_above_bars():
    """While a progress bar is drawn, console log lines print above it (through tqdm.write) instead of running on
    from the bar's line."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    console = [h for h in logging.root.handlers if isinstance(h, logging.StreamHandler)
               and getattr(h, "stream", None) in (sys.stdout, sys.stderr)]
    # Without a console handler (logging not configured, as in a library call) there is nothing to move.
    return logging_redirect_tqdm(tqdm_class=tqdm) if console else contextlib.nullcontext()


@contextlib.contextmanager
def _out_of_space(config: TrainConfig):
    """A full disk (or quota) under any of the run's writes becomes one OSError that says what is safe, instead of
    a traceback from deep inside a writer. Checkpoints are written whole or not at all (``checkpoint.py``)."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        done = list_checkpoints(config.output_dir)
        then = (f"the checkpoints written so far are intact (latest: {done[-1][1]}), and resuming from one continues "
                f"exactly as if the run had not stopped: free space and run it again with --resume (resume='auto')"
                if done else "no checkpoint had been written yet: free space and start again")
        err = OSError(f"no space left on device while writing {e.filename or config.output_dir}; {then}")
        err.errno = e.errno
        raise err from e


def _resume(acc, resume_dir: Path | None, start: int, log: Path) -> None:
    """Load the checkpoint's state; only then drop the log lines past it, so that a failed resume keeps the log."""
    if resume_dir is not None:
        try:
            acc.load_state(str(resume_dir))
        except (RuntimeError, OSError, EOFError, ValueError) as e:
            raise ValueError(f"cannot resume from checkpoint {resume_dir}: {e}. Resume from an earlier checkpoint "
                             f"(--resume DIR) or delete this one") from e
        logger.info("resumed from %s at step %d", resume_dir, start)
    if acc.is_main_process:
        _trim_log(log, start)


def _loop(config, acc, objective, optimizer, scheduler, plan, examples, target, layers, start, cap, on_step,
          result) -> None:
    from tqdm.auto import tqdm

    objective.train()
    schedule = scheduler.lr_lambdas[0]
    pace = Pace(config.max_seconds, schedule, start, cap) if config.max_seconds else None
    # closed on an error too, so that the error's message starts on a line of its own
    with tqdm(total=cap, initial=start, desc=f"train {config.kind}", disable=not acc.is_main_process,
              dynamic_ncols=True) as bar:
        orders: dict[int, list[int]] = {}
        params = [p for p in objective.parameters() if p.requires_grad]
        for step in range(start, cap):
            epoch = step // plan.steps_per_epoch
            if epoch not in orders:
                orders = {epoch: plan.order(epoch)}
            loss_sum, stats_sum = 0.0, 0.0
            for m in range(config.grad_accum):
                rows = plan.rows(step, m, acc.process_index, orders[epoch])
                batch = _batch([examples[r] for r in rows], target, layers, config, acc.device)
                sync = m == config.grad_accum - 1
                with contextlib.nullcontext() if sync else acc.no_sync(objective):
                    loss, stats = objective(batch)
                    acc.backward(loss / config.grad_accum)
                loss_sum, stats_sum = loss_sum + loss.detach().float(), stats_sum + stats
            if config.max_grad_norm > 0:
                acc.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            done = step + 1
            if pace is not None:  # before the scheduler's step, so that the next rate follows the new length
                pace.after(done)
                bar.total = schedule.total
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            metrics = _metrics(acc, loss_sum / config.grad_accum, stats_sum, scheduler.get_last_lr()[0])
            total = schedule.total
            result.step = done
            result.losses.append(metrics["loss"])
            result.accuracies.append(metrics["acc"])
            bar.update()
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", acc="/".join(f"{a:.2f}" for a in metrics["acc"]))
            if acc.is_main_process and (done % config.log_every == 0 or done >= total):
                logger.info("step %d/%d loss %.4f acc %s lr %.3g", done, total, metrics["loss"],
                            [round(a, 3) for a in metrics["acc"]], metrics["lr"])
                with open(Path(config.output_dir) / LOG_NAME, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": done, **metrics}) + "\n")
            if done % config.save_every == 0 or done >= total:
                save_checkpoint(acc, config.output_dir, done, config,
                                lambda path: _export_head(acc, objective, path / "head", config.save_dtype),
                                config.keep_checkpoints)
            if on_step is not None:
                on_step(done, metrics)
            if done >= total:
                break


def _metrics(acc, loss: torch.Tensor, stats: torch.Tensor, lr: float) -> dict:
    """Loss averaged over processes; per-TTT-step accuracy pooled over every process's trained tokens."""
    packed = torch.cat((loss.reshape(1), stats.flatten().float())).to(acc.device)
    packed = acc.reduce(packed, reduction="sum")
    right, counted = packed[1:].view(2, -1)
    acc_list = (right / counted.clamp(min=1)).tolist()
    return {"loss": float(packed[0]) / acc.num_processes, "acc": acc_list, "lr": lr}


def _batch(examples, target, layers, config: TrainConfig, device) -> dict:
    """A collated batch on ``device``, with target features computed now unless they were dumped."""
    batch = collate(examples)
    model_inputs = {k: v.to(device) for k, v in batch.pop("model_inputs", {}).items()}
    batch = {k: v.to(device) for k, v in batch.items()}
    if "features" not in batch:
        # With images: the full VLM forward, and the merged embeddings the head reads (as _prefill gives them).
        got = target_features(target, layers, batch["input_ids"], batch["attention_mask"],
                              with_last=config.kind == "eagle3", model_inputs=model_inputs,
                              input_embeds=bool(model_inputs) and config.image_embeds)
        batch["features"], batch["last_hidden"] = got[0], got[1]
        if model_inputs and config.image_embeds:  # else the head embeds the placeholder tokens itself
            batch["embeds"] = got[2]
    if not config.image_features:
        batch["features"] = hide_image_features(batch["features"], batch["input_ids"],
                                                resolve_target(target).image_token_id)
    return batch


def _load(config: TrainConfig, acc, processor=None, target=None):
    """(target, training examples, held-out examples); the target is loaded whole or embeddings-only, unless given."""
    if target is not None:
        target.eval().requires_grad_(False)
        resolve_target(target)
    if config.features_dir is not None:
        if target is None:
            target = load_target_embeddings(config.target, dtype=config.target_dtype, device=acc.device)
        store = FeatureStore(config.features_dir, max_length=config.max_length)
        store.check(config, resolve_target(target))
        n = len(store) - config.eval_holdout
        held = [store.tokens(i) for i in range(max(n, 0), len(store))]
        examples = _Subset(store, range(max(n, 0)))
    else:
        if target is None:
            target = load_target(config.target, dtype=config.target_dtype, device=acc.device,
                                 device_map=config.target_device_map)
        tokenizer = load_tokenizer(config.target)
        rows = _training_rows(config, acc, target, tokenizer)
        if processor is None and any(has_images(r) for _, r in rows):
            processor = load_processor(config.target)
        all_examples = encode_rows(tokenizer, rows, config.max_length, source=config.data, processor=processor)
        cut = len(all_examples) - config.eval_holdout
        examples, held = all_examples[:max(cut, 0)], all_examples[max(cut, 0):]
    if config.eval_data is not None:
        tokenizer = load_tokenizer(config.target)
        eval_rows = read_rows(config.eval_data, images=True)
        if processor is None and any(has_images(r) for _, r in eval_rows):
            processor = load_processor(config.target)
        held = encode_rows(tokenizer, eval_rows, config.max_length, source=config.eval_data, processor=processor)
    if len(examples) == 0:
        raise ValueError(f"eval_holdout={config.eval_holdout} leaves no training rows")
    return target, examples, held


class _Subset:
    def __init__(self, store, indices):
        self.store, self.indices = store, list(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.store[self.indices[i]]

    def __iter__(self):  # token-only rows, for the draft vocabulary
        return (self.store.tokens(i) for i in self.indices)


def _training_rows(config: TrainConfig, acc, model, tokenizer):
    rows = read_rows(config.data, images=True)
    if not config.regenerate:
        return rows
    cache = Path(config.output_dir) / REGENERATED_NAME
    if acc.is_main_process and not cache.is_file():
        from tqdm.auto import tqdm

        cache.parent.mkdir(parents=True, exist_ok=True)
        with tqdm(total=len(rows), desc="regenerate") as bar:
            write_rows(cache, regenerate_rows(model, tokenizer, rows, config.regenerate_max_new_tokens, bar.update,
                                              batch_size=config.regenerate_batch_size))
    acc.wait_for_everyone()
    new = read_rows(cache, images=True)
    if len(new) != len(rows):
        raise ValueError(f"{cache} has {len(new)} rows but {config.data} has {len(rows)}; delete the stale file")
    return [(n, r) for (n, _), (_, r) in zip(rows, new)]


def _build_head(config: TrainConfig, target, examples):
    """A fresh head (fp32 master weights) or ``init_head``; EAGLE-3 gets its draft vocabulary from the data."""
    if config.init_head is not None:
        head = load_head(config.init_head, target=target, dtype=torch.float32)
        kind = "eagle3" if isinstance(head, Eagle3Head) else "eagle"
        if kind != config.kind:
            raise ValueError(f"init_head {config.init_head} is an {kind} head, but kind={config.kind!r}")
        for name in ("image_embeds", "image_features", *(VARIANTS if kind == "eagle3" else ())):
            if getattr(head.config, name) != getattr(config, name):
                raise ValueError(f"init_head {config.init_head} has {name}={getattr(head.config, name)}, but "
                                 f"{name}={getattr(config, name)}")
        return head.train()
    if config.kind == "eagle":
        return EagleHead.from_target(target, image_embeds=config.image_embeds,
                                     image_features=config.image_features).float().train()
    vocab = resolve_target(target).vocab_size
    draft = config.draft_vocab_size or min(32000, vocab)
    head = Eagle3Head.from_target(target, aux_layers=config.aux_layers, draft_vocab_size=draft,
                                  image_embeds=config.image_embeds, image_features=config.image_features,
                                  **{name: getattr(config, name) for name in VARIANTS}).float()
    head.set_draft_vocab(build_draft_vocab(examples, vocab, draft))
    return head.train()


def _export_head(acc, objective, path: Path, dtype: str) -> None:
    """Write the head in its ``from_pretrained`` layout; gathers FSDP shards first (every process calls this)."""
    state = acc.get_state_dict(objective)
    if acc.is_main_process:
        template = acc.unwrap_model(objective).head
        # A fresh module draws initial weights from the global RNG; fork it so resume stays exact.
        with torch.random.fork_rng(devices=[]):
            head = type(template)(template.config)
        head.load_state_dict({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})
        head.to(getattr(torch, dtype)).save_pretrained(path)
    acc.wait_for_everyone()


def _evaluate(config: TrainConfig, acc, target, held_out) -> float | None:
    value = None
    if acc.is_main_process:
        if config.features_dir is not None:  # trained without the target: load it whole only now
            target = load_target(config.target, dtype=config.target_dtype, device=acc.device,
                                 device_map=config.target_device_map)
        dtype = resolve_target(target).embed.weight.dtype
        head = load_head(config.output_dir, target=target, dtype=dtype)
        prompts = eval_prompts(held_out, config.eval_samples)
        logger.info("evaluating the head on %d held-out prompts (%d new tokens each, the default call's tree)",
                    len(prompts), config.eval_max_new_tokens)
        report = evaluate(target, head, prompts, max_new_tokens=config.eval_max_new_tokens, progress=True)
        value = report["mean_accept_length"]
        (Path(config.output_dir) / EVAL_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        logger.info("mean acceptance length on %d held-out prompts: %.3f (tree %s)", len(prompts), value,
                    report["tree"])
    acc.wait_for_everyone()
    return value


def _trim_log(path: Path, step: int) -> None:
    """Drop log lines past ``step``: a resumed run writes them again. So is a last line cut short (a full disk)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]  # a line without its newline was cut short
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
