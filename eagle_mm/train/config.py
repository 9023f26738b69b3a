"""TrainConfig: every training option and its default, validated once, saved as JSON beside the results.

The command line is generated from these fields (``cli.py``), so a default lives here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TrainConfig", "NON_TRAINING_FIELDS"]

KINDS = ("eagle3", "eagle")
PRECISIONS = ("no", "fp16", "bf16")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Fields that may change between a checkpoint and its resumption: they steer where results go and what is
# logged or evaluated, never a weight or the data order.
NON_TRAINING_FIELDS = frozenset({
    "output_dir", "resume", "save_every", "keep_checkpoints", "log_every", "eval_data", "eval_holdout",
    "eval_samples", "eval_max_new_tokens", "target_device_map", "save_dtype",
})
_PATH_FIELDS = ("target", "data", "output_dir", "features_dir", "init_head", "eval_data")
# The EAGLE-3 variant flags, named as in Eagle3Config.
VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _help(text: str, choices: tuple | None = None, **kw):
    return field(metadata={"help": text, "choices": choices}, **kw)


@dataclass
class TrainConfig:
    """Options of ``eagle_mm.train.train``; see docs/training.md for what each one does to the run."""

    target: str = _help("directory of the target model (and its tokenizer)")
    output_dir: str = _help("where the trained head, train_config.json, logs and checkpoints/ go")
    kind: str = _help("head kind: eagle3 (EAGLE-3, training-time test) or eagle (EAGLE-1/2)", KINDS, default="eagle3")
    data: str | None = _help("JSON-lines training data: {'messages': [...]} chat rows or {'text': ...} rows",
                             default=None)
    features_dir: str | None = _help("train from target features dumped by --dump-features instead of running "
                                     "the target", default=None)
    max_length: int = _help("tokens per row; longer rows are truncated", default=2048)
    regenerate: bool = _help("replace assistant turns by the target's own greedy output before training",
                             default=False)
    regenerate_max_new_tokens: int = _help("token limit of each regenerated assistant turn", default=512)
    # ---- head ----
    draft_vocab_size: int | None = _help("EAGLE-3 draft vocabulary: the most frequent training tokens "
                                         "(default min(32000, target vocab))", default=None)
    aux_layers: tuple[int, ...] | None = _help("EAGLE-3 target hidden_states indices (default 2, N//2, N-3; "
                                               "1, N//2, N-1 on 4-6 layers, where those collide)",
                                               default=None)
    image_embeds: bool = _help("with a vision-language target, the head reads the merged image embeddings at image "
                               "positions; --no-image-embeds hides them (the placeholder token's embedding "
                               "instead: an ablation), saved in the head's config", default=True)
    image_features: bool = _help("with a vision-language target, the head reads the target's features at image "
                                 "positions; --no-image-features zeroes them (with --no-image-embeds: the draft sees "
                                 "nothing of the image's positions, the stricter ablation), saved in the head's "
                                 "config", default=True)
    norm_before_residual: bool = _help("EAGLE-3 variant: the residual around attention starts from the normed "
                                       "hidden state", default=False)
    norm_before_fc: bool = _help("EAGLE-3 variant: one RMSNorm over the concatenated target features before fc "
                                 "(gpt-oss style heads)", default=False)
    fc_norm: bool = _help("EAGLE-3 variant: one RMSNorm per target feature before fc", default=False)
    norm_output: bool = _help("EAGLE-3 variant: feed the normed output back when drafting deeper (EAGLE 3.1)",
                              default=False)
    init_head: str | None = _help("start from this saved head instead of a fresh one", default=None)
    # ---- losses ----
    ttt_steps: int = _help("EAGLE-3 training-time-test unroll length", default=7)
    ttt_decay: float = _help("EAGLE-3 weight of unroll step i is ttt_decay**i", default=0.8)
    feature_noise: float = _help("EAGLE-1 uniform input-feature noise half-width at 512 tokens "
                                 "(scaled by 512/length, as official EAGLE)", default=0.1)
    p_weight: float = _help("EAGLE-1 weight of the token (cross-entropy) loss", default=0.1)
    v_weight: float = _help("EAGLE-1 weight of the feature (smooth-L1) loss", default=1.0)
    # ---- optimisation ----
    epochs: int = _help("passes over the data (ignored when max_steps is set)", default=1)
    max_steps: int | None = _help("optimizer steps to run (default: epochs over the data)", default=None)
    batch_size: int = _help("rows per micro-batch and process", default=1)
    grad_accum: int = _help("micro-batches per optimizer step", default=1)
    lr: float = _help("peak learning rate (AdamW)", default=1e-4)
    warmup_ratio: float = _help("fraction of the steps spent warming the learning rate up linearly", default=0.02)
    min_lr_ratio: float = _help("the cosine schedule ends at lr * min_lr_ratio", default=0.0)
    weight_decay: float = _help("AdamW weight decay", default=0.0)
    adam_betas: tuple[float, float] = _help("AdamW betas", default=(0.9, 0.95))
    max_grad_norm: float = _help("clip the gradient norm to this; 0 turns clipping off", default=0.5)
    mixed_precision: str = _help("accelerate mixed precision", PRECISIONS, default="bf16")
    target_dtype: str = _help("dtype the target is loaded in (auto: the checkpoint's)", DTYPES, default="auto")
    target_device_map: str | None = _help("device_map for the target (one process only, e.g. 'auto' to spread "
                                          "a large target over all GPUs while dumping features)", default=None)
    save_dtype: str = _help("dtype of the saved head", DTYPES[1:], default="bfloat16")
    seed: int = _help("seeds the head's initialisation, the data order and the feature noise", default=0)
    # ---- checkpoints, logs, evaluation ----
    save_every: int = _help("write a resumable checkpoint every this many optimizer steps", default=1000)
    keep_checkpoints: int = _help("checkpoints kept; older ones are deleted after a newer one is complete",
                                  default=2)
    resume: str | None = _help("'auto' (latest checkpoint in output_dir, if any) or a checkpoint directory",
                               default=None)
    log_every: int = _help("log the loss every this many optimizer steps", default=10)
    eval_data: str | None = _help("held-out JSON-lines data for the final acceptance-length evaluation",
                                  default=None)
    eval_holdout: int = _help("hold the last N rows of the training data out for the final evaluation",
                              default=0)
    eval_samples: int = _help("rows evaluated at the end", default=16)
    eval_max_new_tokens: int = _help("tokens generated per evaluated prompt", default=64)

    def __post_init__(self) -> None:
        for name in _PATH_FIELDS:
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not str(value):
                    raise ValueError(f"{name} must be a non-empty path, got {value!r}")
                setattr(self, name, os.path.abspath(os.path.expanduser(str(value))))
        _choice("kind", self.kind, KINDS)
        _choice("mixed_precision", self.mixed_precision, PRECISIONS)
        _choice("target_dtype", self.target_dtype, DTYPES)
        _choice("save_dtype", self.save_dtype, DTYPES[1:])
        if (self.data is None) == (self.features_dir is None):
            raise ValueError(f"give exactly one of data (JSON-lines) and features_dir (dumped features); got "
                             f"data={self.data!r}, features_dir={self.features_dir!r}")
        if self.regenerate and self.features_dir is not None:
            raise ValueError("regenerate=True needs the raw data: dumped features were computed on fixed tokens")
        for name in ("max_length", "regenerate_max_new_tokens", "ttt_steps", "epochs", "batch_size", "grad_accum",
                     "save_every", "keep_checkpoints", "log_every", "eval_samples", "eval_max_new_tokens"):
            _positive_int(name, getattr(self, name))
        for name in ("max_steps", "draft_vocab_size"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if isinstance(self.eval_holdout, bool) or not isinstance(self.eval_holdout, int) or self.eval_holdout < 0:
            raise ValueError(f"eval_holdout must be a non-negative int, got {self.eval_holdout!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.aux_layers is not None:
            self.aux_layers = tuple(self.aux_layers)
            if len(self.aux_layers) != 3 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                for i in self.aux_layers):
                raise ValueError(f"aux_layers must be three non-negative hidden_states indices, got {self.aux_layers!r}")
        variants = [name for name in VARIANTS if getattr(self, name)]
        if variants and self.kind != "eagle3":
            raise ValueError(f"{variants} are EAGLE-3 head variants; kind={self.kind!r} has none")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other (one norm over the features or one each)")
        self.adam_betas = tuple(float(b) for b in self.adam_betas)
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas!r}")
        _in_range("lr", self.lr, 0.0, None, low_open=True)
        _in_range("warmup_ratio", self.warmup_ratio, 0.0, 1.0, high_open=True)
        _in_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _in_range("ttt_decay", self.ttt_decay, 0.0, 1.0, low_open=True)
        for name in ("feature_noise", "p_weight", "v_weight", "weight_decay", "max_grad_norm"):
            _in_range(name, getattr(self, name), 0.0, None)
        if self.resume is not None and self.resume != "auto":
            self.resume = os.path.abspath(os.path.expanduser(str(self.resume)))

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    def save(self, path) -> None:
        """Write the config as JSON (through a temp file, so a reader never sees half of it)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> "TrainConfig":
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def training_difference(self, other: "TrainConfig") -> tuple[str, object, object] | None:
        """The first training-relevant field whose value differs: (name, self's, other's), or None."""
        mine, theirs = self.to_dict(), other.to_dict()
        for f in dataclasses.fields(self):
            if f.name not in NON_TRAINING_FIELDS and mine[f.name] != theirs[f.name]:
                return f.name, mine[f.name], theirs[f.name]
        return None


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _in_range(name, value, low, high, *, low_open=False, high_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    bad = value < low or (low_open and value == low)
    if high is not None:
        bad = bad or value > high or (high_open and value == high)
    if bad:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must lie in {lo}{low}, {high if high is not None else 'inf'}{hi}; got {value!r}")
