"""Training a reference model's draft heads with ``eagle_mm.train``: the settings (``HeadTraining``), text rows,
and one head trained and copied into the build (``train_head``). Shared by code-tiny and scenes-tiny."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["HeadTraining", "text_rows", "write_jsonl", "train_head"]


@dataclass
class HeadTraining:
    """How a reference model's draft heads are trained (fields of ``eagle_mm.train.TrainConfig``; the defaults are
    code-tiny's)."""

    max_length: int = 512
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 16
    lr: float = 5e-4
    warmup_ratio: float = 0.02
    eagle3_draft_vocab: int = 4096
    # hidden_states indices fused by the EAGLE-3 head. The official (2, N//2, N-3) drops the top three of this
    # 8-layer target's layers; the top one is the feature EAGLE-1 drafts from, so it replaces the third.
    eagle3_aux_layers: tuple[int, int, int] | None = (2, 4, 8)
    ttt_steps: int = 7
    eval_samples: int = 16
    eval_max_new_tokens: int = 64


def text_rows(tokenizer, docs, max_tokens: int) -> list[dict]:
    """Documents cut at line ends into {'text': ...} rows of about ``max_tokens`` tokens (the trainer truncates)."""
    rows = []
    for d in docs:
        lines = d.text.splitlines(keepends=True)
        counts = [len(ids) for ids in tokenizer(lines, add_special_tokens=False, verbose=False).input_ids]
        chunk, used = [], 0
        for line, n in zip(lines, counts):
            if chunk and used + n > max_tokens - 1:
                rows.append({"text": "".join(chunk)})
                chunk, used = [], 0
            chunk.append(line)
            used += n
        if chunk and "".join(chunk).strip():
            rows.append({"text": "".join(chunk)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def train_head(h: HeadTraining, kind: str, name: str, out: Path, work: Path, data: str, eval_data: str, seed: int,
               device: torch.device, **fields) -> dict:
    """Train one draft head with ``eagle_mm.train`` on the build's ``out/target``, copy it to ``out/name``, and
    return its manifest entry. ``fields``: further ``TrainConfig`` fields (draft vocabulary, aux layers, ...)."""
    from ..train import TrainConfig, train

    cfg = TrainConfig(
        target=str(out / "target"), data=data, eval_data=eval_data, output_dir=str(work / name), kind=kind,
        max_length=h.max_length, epochs=h.epochs, max_steps=h.max_steps, batch_size=h.batch_size, lr=h.lr,
        warmup_ratio=h.warmup_ratio, ttt_steps=h.ttt_steps, eval_samples=h.eval_samples,
        eval_max_new_tokens=h.eval_max_new_tokens, seed=seed, save_every=10**9, keep_checkpoints=1,
        mixed_precision="bf16" if device.type == "cuda" else "no",
        target_dtype="auto" if device.type == "cuda" else "float32", save_dtype="bfloat16", **fields)
    tick = time.perf_counter()
    result = train(cfg)
    (out / name).mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy2(work / name / f, out / name / f)
    tail = result.losses[-10:]
    return {"train_config": cfg.to_dict() | {"target": "target/", "data": "(build)", "eval_data": "(build)",
                                             "output_dir": "(build)"},
            "steps": result.step, "final_loss": sum(tail) / len(tail), "final_accuracy": result.accuracies[-1],
            "val_mean_accept_length": result.mean_accept_length, "seconds": round(time.perf_counter() - tick, 1)}
