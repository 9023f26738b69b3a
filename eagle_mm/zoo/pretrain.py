"""Pre-training a small ``LlamaForCausalLM`` from scratch on a token stream: the zoo's targets and assistants.

Documents (each starting with ``<|endoftext|>``, which the tokenizer prepends) are concatenated into one
stream and cut into fixed blocks: no padding, so attention is plain causal SDPA. Each epoch shifts the cut by a
random offset, so a block boundary falls at a different place every epoch. AdamW, linear warm-up then cosine
decay, gradient clipping, bf16 autocast on CUDA (fp32 master weights). The validation loss is measured every
``eval_every`` steps and the weights with the lowest one are kept (the corpus is small: a model of this size
overfits it if trained long). Deterministic for a seed on CPU; on CUDA the data order and initial weights are
the same, the kernels' floating-point reductions need not be.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["ModelShape", "PretrainConfig", "PretrainResult", "token_stream", "pretrain", "evaluate", "save_model",
           "count_parameters"]

logger = logging.getLogger(__name__)


@dataclass
class ModelShape:
    """The Llama architecture's size fields (vocabulary excluded: it is the tokenizer's)."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0  # what eagle_mm's heads assume when a config names none

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.num_heads} heads of an even size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")

    def llama_config(self, vocab_size: int, *, eos_token_id: int, bos_token_id: int, pad_token_id: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )


@dataclass
class PretrainConfig:
    """One pre-training run: the model's shape and the optimisation."""

    shape: ModelShape = field(default_factory=ModelShape)
    block_size: int = 512  # tokens per training sequence
    batch_size: int = 32  # sequences per optimizer step
    max_steps: int = 1500
    lr: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # on matrices only (not norms)
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    eval_every: int = 100
    max_seconds: float | None = None  # a guard for a bounded machine: stop early (recorded) after this long
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.shape, dict):
            self.shape = ModelShape(**self.shape)
        for name in ("block_size", "batch_size", "max_steps", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.block_size > self.shape.max_position_embeddings:
            raise ValueError(f"block_size {self.block_size} exceeds max_position_embeddings "
                             f"{self.shape.max_position_embeddings}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0; got lr={self.lr}, "
                             f"min_lr_ratio={self.min_lr_ratio}, warmup_steps={self.warmup_steps}")
        self.betas = tuple(self.betas)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class PretrainResult:
    model: torch.nn.Module  # the kept (lowest validation loss) weights, fp32, in eval mode
    val_loss: float  # nats per predicted validation token
    val_perplexity: float
    best_step: int  # the step whose weights were kept (0: the initial weights)
    steps: int  # steps run
    tokens_seen: int
    seconds: float
    stopped_early: bool  # max_seconds ran out before max_steps
    history: list[dict] = field(default_factory=list)  # every evaluation: step, train loss, val loss, tokens/s

    def summary(self) -> dict:
        return {"val_loss": self.val_loss, "val_perplexity": self.val_perplexity, "best_step": self.best_step,
                "steps": self.steps, "tokens_seen": self.tokens_seen, "seconds": round(self.seconds, 1),
                "stopped_early": self.stopped_early, "history": self.history}


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """(N,) every text tokenised with the tokenizer's special tokens (a leading ``<|endoftext|>``), concatenated."""
    ids = tokenizer(texts, add_special_tokens=True, verbose=False).input_ids
    return torch.tensor([t for doc in ids for t in doc], dtype=torch.long)


def _windows(stream: torch.Tensor, block: int, offset: int = 0) -> torch.Tensor:
    """(N, block + 1) windows overlapping by one token: inputs [:, :-1], labels [:, 1:]."""
    usable = stream[offset:]
    n = (usable.numel() - 1) // block
    if n == 0:
        return usable.new_empty((0, block + 1))
    return usable[: n * block + 1].unfold(0, block + 1, block)


def _batches(stream: torch.Tensor, cfg: PretrainConfig, gen: torch.Generator):
    """Endless (B, block + 1) batches; a new random offset and order every epoch."""
    while True:
        offset = int(torch.randint(cfg.block_size, (1,), generator=gen))
        windows = _windows(stream, cfg.block_size, offset)
        if len(windows) < cfg.batch_size:
            raise ValueError(f"the training stream ({stream.numel()} tokens) gives {len(windows)} blocks of "
                             f"{cfg.block_size}, fewer than batch_size {cfg.batch_size}")
        order = torch.randperm(len(windows), generator=gen)
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            yield windows[order[i: i + cfg.batch_size]]


def _autocast(device: torch.device):
    # bf16 autocast on CUDA only: on a CPU it is much slower than fp32.
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _loss(model, windows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
    logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, *, block_size: int, batch_size: int = 16) -> float:
    """Mean loss (nats) over every token of ``stream`` after its first, in blocks of ``block_size``."""
    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    full = _windows(stream, block_size)
    tail = stream[len(full) * block_size:]  # the last partial block: predicted too, so no token is skipped
    chunks = [full[i: i + batch_size] for i in range(0, len(full), batch_size)]
    if tail.numel() > 1:
        chunks.append(tail[None])
    for chunk in chunks:
        chunk = chunk.to(device)
        with _autocast(device):
            total += float(_loss(model, chunk, reduction="sum"))
        count += chunk.numel() - chunk.shape[0]
    model.train(was_training)
    return total / max(count, 1)


def _optimizer(model, cfg: PretrainConfig, device: torch.device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")


def _lr_factor(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def pretrain(cfg: PretrainConfig, train_stream: torch.Tensor, val_stream: torch.Tensor, *, vocab_size: int,
             eot_id: int, device="cpu", on_eval=None) -> PretrainResult:
    """Train a fresh ``LlamaForCausalLM`` shaped by ``cfg.shape`` on ``train_stream``; keep the best weights.

    ``on_eval(record)`` is called after every evaluation (e.g. to print progress).
    """
    from transformers import LlamaForCausalLM

    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    config = cfg.shape.llama_config(vocab_size, eos_token_id=eot_id, bos_token_id=eot_id, pad_token_id=eot_id)
    model = LlamaForCausalLM(config).to(device).train()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = eot_id
    optimizer = _optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, cfg))
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = _batches(train_stream, cfg, gen)

    def val_loss() -> float:
        return evaluate(model, val_stream, block_size=cfg.block_size, batch_size=max(1, cfg.batch_size // 2))

    best_loss, best_step = val_loss(), 0
    best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    history = [{"step": 0, "val_loss": best_loss}]
    start = time.perf_counter()
    tokens, running, stopped_early, step = 0, [], False, 0
    for step in range(1, cfg.max_steps + 1):
        windows = next(batches).to(device, non_blocking=True)  # (B, block + 1)
        with _autocast(device):
            loss = _loss(model, windows)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += windows.shape[0] * cfg.block_size
        running.append(loss.detach())
        out_of_time = cfg.max_seconds is not None and time.perf_counter() - start > cfg.max_seconds
        if step % cfg.eval_every == 0 or step == cfg.max_steps or out_of_time:
            train_loss = float(torch.stack(running).mean())  # the one host sync of an evaluation period
            running = []
            loss_now = val_loss()
            elapsed = time.perf_counter() - start
            record = {"step": step, "train_loss": train_loss, "val_loss": loss_now, "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": round(tokens / elapsed)}
            history.append(record)
            logger.info("step %d/%d train %.4f val %.4f (%.0f tokens/s)", step, cfg.max_steps, train_loss, loss_now,
                        tokens / elapsed)
            if on_eval is not None:
                on_eval(record)
            if loss_now < best_loss:
                best_loss, best_step = loss_now, step
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            if out_of_time:
                stopped_early = step < cfg.max_steps
                break
    seconds = time.perf_counter() - start
    model.load_state_dict(best_state)
    model.eval()
    return PretrainResult(model=model, val_loss=best_loss, val_perplexity=math.exp(best_loss), best_step=best_step,
                          steps=step, tokens_seen=tokens, seconds=seconds, stopped_early=stopped_early,
                          history=history)


def save_model(model, path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str = "14MB") -> None:
    """``save_pretrained`` in ``dtype`` as safetensors shards of at most ``max_shard_size``; ``model`` is unchanged."""
    import copy

    copy.deepcopy(model).to("cpu", dtype).save_pretrained(str(path), max_shard_size=max_shard_size)
