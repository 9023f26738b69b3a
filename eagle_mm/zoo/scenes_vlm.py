"""The scenes-tiny VLM: its tokenizer and processor, a LLaVA model built from config classes, its training from
scratch on procedural scenes (``scenes_data``), and greedy evaluation per task.

A prompt is ``<|endoftext|>{question}\\n<image>``: the image comes last, so the answer's tokens are the ones
right after the image. The processor (``LlavaProcessor`` with a ``CLIPImageProcessorPil`` made from arguments)
expands ``<image>`` to one token per image patch; the chat template writes the same prompt from
``[{"role": "user", "content": [text, image]}, {"role": "assistant", "content": answer}]``.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import scenes_data as sd
from .tokenizer import EOT

__all__ = ["IMAGE_TOKEN", "CHAT_TEMPLATE", "VLMShape", "VLMTraining", "ScenePool", "PromptEncoder", "train_tokenizer",
           "make_processor", "make_model", "pixels", "render_pool", "pretrain_vlm", "answer", "evaluate_tasks"]

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
# user: text parts, each followed by a newline, and images; assistant: the answer and <|endoftext|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% elif m['content'] is string %}{{ m['content'] }}\n{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ p['text'] }}\n{% endif %}{% endfor %}"
    "{% endif %}{% endfor %}"
)
_MEAN_STD = [0.5, 0.5, 0.5]  # pixels in [-1, 1]


@dataclass
class VLMShape:
    """Sizes of the LLaVA model: a Llama language model and a CLIP vision tower (vocabulary: the tokenizer's)."""

    hidden_size: int = 256
    intermediate_size: int = 640
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    vision_hidden_size: int = 192
    vision_intermediate_size: int = 768
    vision_layers: int = 4
    vision_heads: int = 3
    image_size: int = 96
    patch_size: int = 12
    max_position_embeddings: int = 512

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}")
        if self.image_size < 48:
            raise ValueError(f"image_size {self.image_size}: scenes render at 48 pixels or more")

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass
class VLMTraining:
    """Training the VLM from scratch. The learning-rate schedule runs on ``max(step / max_steps, elapsed /
    max_seconds)``: whichever runs out first ends a complete warm-up-then-cosine schedule."""

    # Distinct training scenes rendered once (each step draws a new question about one). 48k scenes seen ~23 times
    # each fitted the training set (loss 0.13) but left relation questions at chance on validation scenes.
    scenes: int = 200_000
    batch_size: int = 384
    max_steps: int = 8000
    max_seconds: float | None = 330.0
    lr: float = 2e-3
    warmup: float = 0.03  # fraction of the schedule
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.05
    # Rows that are captions (the longest answers, nearly free: a batch is padded to its longest row anyway); the
    # others draw a task uniformly, then a question, as scenes_data.examples does.
    caption_share: float = 0.2
    log_every: int = 100
    seed: int = 0
    workers: int = 0  # rendering processes (0: one per CPU core, at most 16)


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE on ``texts`` with ``<|endoftext|>`` (BOS/EOS/PAD) and ``<image>`` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, IMAGE_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   extra_special_tokens={"image_token": IMAGE_TOKEN}, model_max_length=512,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_processor(tokenizer, shape: VLMShape):
    """LlavaProcessor: images resized to ``image_size`` square, scaled to [-1, 1]; ``<image>`` -> patch tokens."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    side = shape.image_size
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                   image_mean=_MEAN_STD, image_std=_MEAN_STD)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=shape.patch_size,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE)


def make_model(shape: VLMShape, tokenizer):
    """A freshly initialised ``LlavaForConditionalGeneration`` (sdpa attention, tied embeddings)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    eot = tokenizer.convert_tokens_to_ids(EOT)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    vision = CLIPVisionConfig(hidden_size=shape.vision_hidden_size, intermediate_size=shape.vision_intermediate_size,
                              num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                              image_size=shape.image_size, patch_size=shape.patch_size)
    config = LlavaConfig(text_config=text, vision_config=vision, image_seq_length=shape.image_tokens,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1,
                         vision_feature_select_strategy="default", tie_word_embeddings=True)
    model = LlavaForConditionalGeneration(config)
    model.set_attn_implementation("sdpa")
    model.generation_config.update(pad_token_id=eot, eos_token_id=eot, bos_token_id=eot)
    return model


def pixels(images: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float in [-1, 1]: what the processor makes of a scene at its size."""
    return images.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


# ---- the rendered training scenes -------------------------------------------------------------------------
@dataclass
class ScenePool:
    images: torch.Tensor  # (N, S, S, 3) uint8
    qa: list[list[tuple[str, str, str]]]  # every (task, question, answer) of each scene
    seeds: list[int] = field(default_factory=list)


def _render_chunk(args) -> tuple[np.ndarray, list]:
    seeds, size = args
    scenes = [sd.make_scene(s) for s in seeds]
    return np.stack([np.asarray(sd.render(s, size)) for s in scenes]), [sd.qa_pairs(s) for s in scenes]


def render_pool(seeds: list[int], size: int, workers: int = 0) -> ScenePool:
    """Scenes of ``seeds`` drawn and rendered, over ``workers`` processes (0: one per core, at most 16)."""
    import os

    workers = workers or min(16, os.cpu_count() or 1)
    chunks = [(seeds[i: i + 500], size) for i in range(0, len(seeds), 500)]
    if workers > 1 and len(chunks) > 1:
        # fork: the workers need only pillow and scenes_data, not a fresh interpreter's imports. Call this before
        # CUDA or the tokenizers' threads start (the build renders its pool first).
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            parts = list(pool.map(_render_chunk, chunks))
    else:
        parts = [_render_chunk(c) for c in chunks]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))  # (N, S, S, 3)
    return ScenePool(images, [qa for p in parts for qa in p[1]], list(seeds))


def _choose(qa: list, rng: random.Random, caption_share: float) -> tuple[str, str, str]:
    if rng.random() < caption_share:
        return qa[0]  # qa_pairs lists the caption first
    tasks = sorted({t for t, _, _ in qa})
    task = rng.choice(tasks)
    return rng.choice([x for x in qa if x[0] == task])


class PromptEncoder:
    """The one prompt format, for training, grading and decoding: ``<|endoftext|> question \\n <image> x N``, then
    the answer. Token ids are remembered (a few hundred distinct questions, captions once each)."""

    def __init__(self, tokenizer, image_tokens: int):
        self.tok, self.cache = tokenizer, {}
        self.eot = tokenizer.convert_tokens_to_ids(EOT)
        self.image = [tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)] * image_tokens

    def ids(self, text: str) -> list[int]:
        if text not in self.cache:
            self.cache[text] = self.tok(text, add_special_tokens=False).input_ids
        return self.cache[text]

    def prompt(self, question: str) -> list[int]:
        return [self.eot] + self.ids(question + "\n") + self.image

    def row(self, question: str, answer: str) -> tuple[list[int], int]:
        """(prompt + answer + <|endoftext|> ids, where the answer starts)."""
        p = self.prompt(question)
        return p + self.ids(answer) + [self.eot], len(p)


def _batch(pool: ScenePool, enc: PromptEncoder, idx: list[int], rng: random.Random, cfg: VLMTraining, device):
    rows = [enc.row(*_choose(pool.qa[i], rng, cfg.caption_share)[1:]) for i in idx]
    T = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), T), enc.eot, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for b, (r, start) in enumerate(rows):  # right padding: causal attention needs no mask for it
        ids[b, : len(r)] = torch.tensor(r)
        labels[b, start: len(r)] = ids[b, start: len(r)]
    return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def _lr_factor(progress: float, cfg: VLMTraining) -> float:
    if progress < cfg.warmup:
        return max(progress / cfg.warmup, 0.01)
    x = min(1.0, (progress - cfg.warmup) / max(1e-9, 1 - cfg.warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * x))


def pretrain_vlm(model, tokenizer, pool: ScenePool, cfg: VLMTraining, device) -> dict:
    """Train ``model`` (in place) on questions about the pool's scenes; the loss covers the answers only."""
    device = torch.device(device)
    model.to(device).train()
    enc = PromptEncoder(tokenizer, model.config.image_seq_length)
    images = pool.images.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    rng = random.Random(cfg.seed)
    cuda = device.type == "cuda"  # bf16 autocast on CUDA only: on a CPU it is much slower than fp32
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    history, running, tokens, step = [], [], 0, 0
    start = time.perf_counter()
    progress = 0.0
    while progress < 1.0:
        factor = _lr_factor(progress, cfg)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * factor
        idx = [rng.randrange(len(pool.qa)) for _ in range(cfg.batch_size)]
        ids, labels = _batch(pool, enc, idx, rng, cfg, device)  # (B, T) each
        pix = pixels(images[torch.tensor(idx, device=device)])  # (B, 3, S, S)
        with amp:
            logits = model(input_ids=ids, pixel_values=pix, use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += int(ids.numel())
        running.append(loss.detach())
        elapsed = time.perf_counter() - start
        progress = step / cfg.max_steps
        if cfg.max_seconds is not None:
            progress = max(progress, elapsed / cfg.max_seconds)
        if step % cfg.log_every == 0 or progress >= 1.0:
            mean = float(torch.stack(running).mean())  # the one host sync of a logging period
            running = []
            history.append({"step": step, "loss": mean, "lr": cfg.lr * factor, "seconds": round(elapsed, 1),
                            "tokens_per_s": round(tokens / elapsed)})
            logger.info("vlm step %d loss %.4f lr %.2e (%.0f tokens/s, %.0f s)", step, mean, cfg.lr * factor,
                        tokens / elapsed, elapsed)
    model.eval()
    seconds = time.perf_counter() - start
    return {"steps": step, "seconds": round(seconds, 1), "tokens": tokens, "examples": step * cfg.batch_size,
            "final_loss": history[-1]["loss"], "history": history, "config": asdict(cfg)}


# ---- answering and grading ----------------------------------------------------------------------------------
@torch.no_grad()
def answer(model, tokenizer, images: torch.Tensor, questions: list[str], *, max_new_tokens: int = 96,
           batch_size: int = 256) -> list[str]:
    """Greedy answers: images (N, S, S, 3) uint8 at the model's size, one question each."""
    device = model.get_input_embeddings().weight.device
    enc = PromptEncoder(tokenizer, model.config.image_seq_length)
    out = []
    for i in range(0, len(questions), batch_size):
        prompts = [enc.prompt(q) for q in questions[i: i + batch_size]]
        T = max(len(p) for p in prompts)
        ids = torch.tensor([[enc.eot] * (T - len(p)) + p for p in prompts], device=device)  # left padding
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)
        pix = pixels(images[i: i + batch_size].to(device)).to(model.dtype)
        gen = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pix, max_new_tokens=max_new_tokens,
                             do_sample=False)
        out += tokenizer.batch_decode(gen[:, T:], skip_special_tokens=True)
    return out


def evaluate_tasks(model, tokenizer, n: int, size: int, *, max_new_tokens: int = 96) -> dict:
    """Accuracy per task (exact match after ``scenes_data.score``'s normalisation) on ``n`` validation examples."""
    examples = list(sd.examples("validation", n, size=size))
    images = torch.from_numpy(np.stack([np.asarray(ex["image"]) for ex in examples]))
    tick = time.perf_counter()
    answers = answer(model, tokenizer, images, [ex["prompt"] for ex in examples], max_new_tokens=max_new_tokens)
    acc = sd.accuracy((ex["task"], a, ex["answer"]) for ex, a in zip(examples, answers))
    counts = {t: sum(ex["task"] == t for ex in examples) for t in sd.TASKS}
    samples = [{"seed": ex["seed"], "task": ex["task"], "prompt": ex["prompt"], "answer": ex["answer"],
                "prediction": a} for ex, a in list(zip(examples, answers))[:12]]
    return {"examples": n, "accuracy": acc, "counts": counts, "samples": samples,
            "seconds": round(time.perf_counter() - tick, 1)}
