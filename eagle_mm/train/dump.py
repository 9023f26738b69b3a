"""Target features dumped once to safetensors shards, and streamed back for training without the target.

Layout of a dump directory: ``shard-rRRR-KKKKK.safetensors`` files holding, per row ``i``, the tensors
``i.input_ids`` (T,) int64, ``i.loss_mask`` (T,) bool, ``i.features`` (T, F) in the target's dtype and, for
EAGLE-3, ``i.last_hidden`` (T, H) (the target's last normed hidden state, for its logits); and ``index.json``
(what was dumped and which shard holds each row), written last: a dump without it is incomplete.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..hf.parts import execution_device, resolve_target
from ..config import Eagle3Config
from .accelerator import make_accelerator
from .config import TrainConfig
from .data import Example, encode_rows, read_rows
from .regenerate import regenerate_rows
from .target import load_target, load_tokenizer, target_features

__all__ = ["dump_features", "FeatureStore", "feature_layers"]

logger = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT = 1


def feature_layers(config: TrainConfig, num_layers: int) -> tuple[int, ...]:
    """The target hidden_states indices a head of ``config.kind`` reads."""
    if config.kind == "eagle":
        return (num_layers,)
    return tuple(config.aux_layers or Eagle3Config.default_aux_layers(num_layers))


def dump_features(config: TrainConfig, out_dir, *, shard_bytes: int = 1 << 30, accelerator=None) -> Path:
    """Run the target once over ``config.data`` and write its features to ``out_dir``; returns ``out_dir``.

    Under ``accelerate launch`` each process dumps every ``num_processes``-th row. ``config.regenerate`` is
    applied first; ``config.max_length`` truncates.
    """
    from tqdm.auto import tqdm

    acc = accelerator or make_accelerator()
    out = Path(out_dir)
    if (out / INDEX).exists():
        raise ValueError(f"{out} already holds dumped features ({INDEX}); choose another directory")
    if config.target_device_map is not None and acc.num_processes > 1:
        raise ValueError(f"target_device_map={config.target_device_map!r} spreads the target over this "
                         f"machine's devices from one process; run without accelerate launch")
    # Image rows are refused: dumped features hold no image inputs (the head needs the merged embeddings too).
    rows = read_rows(config.data)[acc.process_index::acc.num_processes]
    model = load_target(config.target, dtype=config.target_dtype, device=acc.device,
                        device_map=config.target_device_map)
    tokenizer = load_tokenizer(config.target)
    parts = resolve_target(model)
    layers = feature_layers(config, parts.num_layers)
    with_last = config.kind == "eagle3"
    bar = tqdm(total=len(rows), desc=f"dump r{acc.process_index}", disable=not acc.is_local_main_process)
    if config.regenerate:
        regenerated = regenerate_rows(model, tokenizer, rows, config.regenerate_max_new_tokens,
                                      batch_size=config.regenerate_batch_size)
        rows = [(n, r) for (n, _), r in zip(rows, regenerated)]
    examples = encode_rows(tokenizer, rows, config.max_length, source=config.data)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    acc.wait_for_everyone()
    device = execution_device(parts.embed)
    shard, size, k = {}, 0, 0
    for ex in examples:
        ids = ex.input_ids[None].to(device)
        feats, last = target_features(model, layers, ids, torch.ones_like(ids), with_last=with_last)
        key = f"{ex.row:09d}"
        shard[f"{key}.input_ids"], shard[f"{key}.loss_mask"] = ex.input_ids, ex.loss_mask
        shard[f"{key}.features"] = feats[0].cpu().contiguous()
        if last is not None:
            shard[f"{key}.last_hidden"] = last[0].cpu().contiguous()
        size += sum(shard[f"{key}.{n}"].nbytes for n in ("features", "last_hidden") if f"{key}.{n}" in shard)
        if size >= shard_bytes:
            _write_shard(out, acc.process_index, k, shard)
            shard, size, k = {}, 0, k + 1
        bar.update()
    if shard:
        _write_shard(out, acc.process_index, k, shard)
    bar.close()
    acc.wait_for_everyone()
    if acc.is_main_process:
        _write_index(out, config, parts, layers, with_last)
    acc.wait_for_everyone()
    return out


def _write_shard(out: Path, rank: int, k: int, tensors: dict) -> None:
    name = f"shard-r{rank:03d}-{k:05d}.safetensors"
    tmp = out / f".{name}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / name)


def _write_index(out: Path, config: TrainConfig, parts, layers, with_last: bool) -> None:
    rows = []
    for shard in sorted(out.glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            rows += [(k.split(".")[0], shard.name) for k in f.keys() if k.endswith(".input_ids")]
    index = {
        "format": FORMAT, "kind": config.kind, "feature_layers": list(layers), "with_last": with_last,
        "num_layers": parts.num_layers, "hidden_size": parts.hidden_size, "vocab_size": parts.vocab_size,
        "target": config.target, "max_length": config.max_length, "rows": sorted(rows),
    }
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / INDEX)
    logger.info("dumped features of %d rows to %s", len(rows), out)


class FeatureStore:
    """Random access to a dump: ``store[i]`` is an ``Example`` with ``tensors`` features (and last_hidden)."""

    def __init__(self, path, max_length: int | None = None):
        self.path = Path(path)
        index = self.path / INDEX
        if not index.is_file():
            raise FileNotFoundError(f"{self.path} has no {INDEX}: not a feature dump, or one that did not finish")
        self.meta = json.loads(index.read_text(encoding="utf-8"))
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{index} has format {self.meta.get('format')!r}; this version reads format {FORMAT}")
        self.rows = [tuple(r) for r in self.meta["rows"]]
        self.max_length = max_length
        self._files: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def _get(self, shard: str, key: str) -> torch.Tensor:
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = safe_open(str(self.path / shard), framework="pt")
        t = f.get_tensor(key)
        return t if self.max_length is None else t[: self.max_length]

    def tokens(self, i: int) -> Example:
        """Row ``i`` without its features (cheap: for the draft vocabulary and prompts)."""
        key, shard = self.rows[i]
        return Example(self._get(shard, f"{key}.input_ids"), self._get(shard, f"{key}.loss_mask"), int(key))

    def __getitem__(self, i: int) -> Example:
        ex = self.tokens(i)
        key, shard = self.rows[i]
        names = ("features", "last_hidden") if self.meta["with_last"] else ("features",)
        ex.tensors = {n: self._get(shard, f"{key}.{n}") for n in names}
        return ex

    def check(self, config: TrainConfig, parts) -> None:
        """ValueError naming the field when this dump does not fit ``config`` and its target."""
        expect = {"kind": config.kind, "feature_layers": list(feature_layers(config, parts.num_layers)),
                  "num_layers": parts.num_layers, "hidden_size": parts.hidden_size, "vocab_size": parts.vocab_size}
        for name, value in expect.items():
            if self.meta.get(name) != value:
                raise ValueError(f"features_dir {self.path} was dumped with {name}={self.meta.get(name)!r}, but this "
                                 f"run needs {name}={value!r}")
