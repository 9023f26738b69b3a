"""Training data: JSON-lines rows -> token ids with a loss mask; the draft vocabulary; batch order.

A row is ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered with the target tokenizer's chat
template; the loss covers the assistant turns only) or ``{"text": ...}`` (the loss covers every token).
Rows may name images (``"images": [paths]`` or content parts ``{"type": "image", "image": path}``; relative
paths are read from the data file's folder and made absolute by ``read_rows``). Such a row is rendered as
usual (a ``{"type": "image"}`` content part is the chat template's image placeholder), then the target's
HF processor expands each placeholder to the image's feature count and turns the images into pixel inputs;
those go to ``Example.model_inputs`` and on to the frozen target's forward. The loss mask is carried over
from the unexpanded tokens (image tokens are never trained).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["Example", "read_rows", "encode_rows", "has_images", "PER_TOKEN_INPUTS", "build_draft_vocab", "collate",
           "BatchPlan", "write_rows"]

logger = logging.getLogger(__name__)


@dataclass
class Example:
    input_ids: torch.Tensor  # (T,) long
    loss_mask: torch.Tensor  # (T,) bool: the token is one the head learns to predict (an assistant token)
    row: int  # line number in the source file (1-based), for error messages
    tensors: dict = field(default_factory=dict)  # per-token tensors (T, ...): dumped "features", "last_hidden"
    # extra target inputs of a VLM row: per-image tensors (pixel_values, image_grid_thw, ...; concatenated
    # along dim 0 in a batch) and per-token ones of shape (T,) (token_type_ids, ...; padded like input_ids)
    model_inputs: dict = field(default_factory=dict)

# Processor outputs that hold one value per token: padded in a batch, not concatenated.
PER_TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")


# ---- reading and checking rows ---------------------------------------------------------------------
def read_rows(path, *, images: bool = False) -> list[tuple[int, dict]]:
    """(line number, row) for every non-blank line; ValueError naming the line for a malformed row.

    Image paths are checked and made absolute. ``images=False`` (for callers with no vision-language path,
    such as feature dumping) refuses rows with images; the trainer reads with ``images=True``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training data file {str(path)!r} does not exist")
    rows = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is named, not the file's decoder position
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} row {lineno}: not valid UTF-8 (byte {raw[e.start:e.end]!r} at column "
                                 f"{e.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} row {lineno}: not valid JSON ({e})") from e
            _check_row(row, lineno, path, images)
            rows.append((lineno, _absolute_images(row, path.parent)))
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def _check_row(row, lineno: int, path: Path, allow_images: bool) -> None:
    where = f"{path} row {lineno}"
    if not isinstance(row, dict) or ("messages" in row) == ("text" in row):
        raise ValueError(f"{where}: expected an object with either 'messages' (chat) or 'text', got {str(row)[:80]!r}")
    if "text" in row and not isinstance(row["text"], str):
        raise ValueError(f"{where}: 'text' must be a string, got {type(row['text']).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
            raise ValueError(f"{where}: 'messages' must be a list of {{'role': ..., 'content': ...}} objects")
        if not any(m["role"] == "assistant" for m in msgs):
            roles = [m["role"] for m in msgs]
            raise ValueError(f"{where}: no assistant turn (roles {roles}); the loss is computed on assistant tokens only")
    images = _image_paths(row)
    for image in images:
        full = image if os.path.isabs(image) else os.path.join(path.parent, image)
        if not os.path.isfile(full):
            raise ValueError(f"{where}: image {image!r} does not exist (looked for {full})")
    if images and not allow_images:
        raise ValueError(f"{where}: rows with images need the vision-language data path (online training with the "
                         f"target's processor); this reader takes text rows only")


def _absolute_images(row: dict, root: Path) -> dict:
    """The row with every image path made absolute (relative ones are relative to ``root``)."""
    def fix(p: str) -> str:
        return p if os.path.isabs(p) else os.path.abspath(os.path.join(root, p))

    if not _image_paths(row):
        return row
    row = dict(row)
    if row.get("images"):
        row["images"] = [fix(p) for p in row["images"]]
    if "messages" in row:
        msgs = []
        for m in row["messages"]:
            if isinstance(m.get("content"), list):
                m = {**m, "content": [{**p, "image": fix(p["image"])} if isinstance(p, dict) and isinstance(
                    p.get("image"), str) else p for p in m["content"]]}
            msgs.append(m)
        row["messages"] = msgs
    return row


def has_images(row: dict) -> bool:
    return bool(_image_paths(row))


def _image_paths(row: dict) -> list[str]:
    paths = list(row.get("images") or [])
    for m in row.get("messages") or []:
        if isinstance(m.get("content"), list):
            paths += [p["image"] for p in m["content"] if isinstance(p, dict) and isinstance(p.get("image"), str)]
    return paths


def write_rows(path, rows: list[dict]) -> None:
    """Write rows as JSON lines through a temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ---- tokenisation ----------------------------------------------------------------------------------
def encode_rows(tokenizer, rows: list[tuple[int, dict]], max_length: int, source="data",
                processor=None) -> list[Example]:
    """Tokenise rows; rows whose trained tokens all fall beyond ``max_length`` are dropped with a warning.

    Rows with images need ``processor``, the target's HF processor (its image processor makes the pixel
    inputs, and it expands each image placeholder to the image's feature count). Chat rows are rendered
    with the processor's chat template when it has one, else the tokenizer's.
    """
    renderer = processor if getattr(processor, "chat_template", None) else tokenizer
    if any("messages" in r for _, r in rows) and not getattr(renderer, "chat_template", None):
        first = next(n for n, r in rows if "messages" in r)
        raise ValueError(f"the target's tokenizer has no chat_template, but {source} row {first} is a chat "
                         f"('messages') row; set tokenizer.chat_template or give {{'text': ...}} rows")
    if processor is None and any(has_images(r) for _, r in rows):
        first = next(n for n, r in rows if has_images(r))
        raise ValueError(f"{source} row {first} has images, which need the target's processor (pass processor=..., "
                         f"or save one with the target so that AutoProcessor loads it)")
    out, dropped, cut = [], [], []
    for lineno, row in rows:
        where = f"{source} row {lineno}"
        if "text" in row:
            text, spans, special = row["text"], None, True
        else:
            text, spans, special = *_render_chat(renderer, row["messages"], where), False
        ids, mask = _tokenize(tokenizer, text, spans, special)
        inputs, image_part = {}, []
        if has_images(row):
            ids, mask, inputs, image_part = _expand_images(processor, tokenizer, row, text, ids, mask, special, where)
        n = min(len(ids), max_length)
        if any(image_part[n:]):
            cut.append(lineno)  # truncation would cut an image's tokens apart from its pixels
            continue
        ids, mask = torch.tensor(ids[:n], dtype=torch.long), torch.tensor(mask[:n], dtype=torch.bool)
        if ids.numel() < 3 or not bool(mask[2:].any()):
            dropped.append(lineno)  # nothing to predict: entry t predicts token t+2
            continue
        inputs = {k: v[:n] if k in PER_TOKEN_INPUTS else v for k, v in inputs.items()}
        out.append(Example(ids, mask, lineno, model_inputs=inputs))
    if dropped:
        logger.warning("dropped %d row(s) of %s with no trained token within max_length=%d (rows %s)",
                       len(dropped), source, max_length, dropped[:10])
    if cut:
        logger.warning("dropped %d row(s) of %s whose image tokens reach past max_length=%d (rows %s)",
                       len(cut), source, max_length, cut[:10])
    if not out:
        raise ValueError(f"no usable rows in {source}: every row is too short or has no trained token within "
                         f"max_length={max_length}")
    return out


def _render(tokenizer, messages, where: str, **kw) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    except Exception as e:  # jinja errors from a template are of many kinds; name the row
        raise ValueError(f"{where}: the chat template failed on this conversation: {e}") from e


def _render_chat(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (their end marker too)."""
    text = _render(tokenizer, messages, where)
    spans, cursor = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], where, add_generation_prompt=True)
        through = _render(tokenizer, messages[: k + 1], where)
        if text.startswith(through) and through.startswith(before) and len(before) >= cursor:
            span = (len(before), len(through))
        else:
            # Templates that rewrite earlier turns (e.g. drop reasoning) are not prefix-stable: find the content.
            content = m.get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            start = text.find(content, cursor) if content else -1
            if start < 0:
                raise ValueError(f"{where}: cannot locate assistant turn {k} in the rendered conversation")
            span = (start, start + len(content))
        spans.append(span)
        cursor = span[1]
    return text, spans


def _tokenize(tokenizer, text: str, spans, special: bool) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` and a mask of the tokens starting inside ``spans`` (every token when None)."""
    if spans is None:
        ids = tokenizer(text, add_special_tokens=special).input_ids
        return list(ids), [True] * len(ids)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        mask = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask
    # Slow tokenizers give no offsets: count tokens of the text up to each span boundary instead.
    ids = tokenizer(text, add_special_tokens=special).input_ids
    mask = [False] * len(ids)
    for a, b in spans:
        lo = len(tokenizer(text[:a], add_special_tokens=special).input_ids)
        hi = len(tokenizer(text[:b], add_special_tokens=special).input_ids)
        mask[lo:hi] = [True] * (hi - lo)
    return list(ids), mask


def _image_token_id(processor, tokenizer) -> int | None:
    tid = getattr(processor, "image_token_id", None)
    if tid is None and getattr(processor, "image_token", None):
        tid = tokenizer.convert_tokens_to_ids(processor.image_token)
    return tid


def _load_images(row: dict, where: str) -> list:
    from PIL import Image

    images = []
    for p in _image_paths(row):
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except Exception as e:  # PIL raises several kinds for unreadable files
            raise ValueError(f"{where}: cannot read image {p!r}: {e}") from e
    return images


def _expand_images(processor, tokenizer, row: dict, text: str, ids: list[int], mask: list[bool], special: bool,
                   where: str):
    """Run the processor on the row's text and images: (expanded ids, mask carried over, per-row model inputs,
    which tokens belong to an image: its placeholder and every token the processor inserted).

    The processor only inserts tokens (each image placeholder repeated to its feature count, and for some
    families begin/end-of-image markers); the unexpanded tokens are matched in order and keep their mask
    value, inserted ones are not trained.
    """
    images = _load_images(row, where)
    try:
        enc = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=special)
    except Exception as e:  # the processor's own count checks and shape errors
        raise ValueError(f"{where}: the target's processor failed on this row ({len(images)} image(s)): {e}") from e
    full = enc["input_ids"][0].tolist()
    new_mask, inserted, j = [], [], 0
    for t in full:
        if j < len(ids) and t == ids[j]:
            new_mask.append(mask[j])
            inserted.append(False)
            j += 1
        else:
            new_mask.append(False)
            inserted.append(True)
    if j != len(ids):
        raise ValueError(f"{where}: the processor's token ids do not extend the tokenizer's (matched {j} of "
                         f"{len(ids)} tokens); the processor must only insert image tokens")
    image_id = _image_token_id(processor, tokenizer)
    image_part = [ins or t == image_id for t, ins in zip(full, inserted)]  # an image's tokens, never trained
    new_mask = [m and not part for m, part in zip(new_mask, image_part)]
    inputs = {}
    for k, v in enc.items():
        if k in ("input_ids", "attention_mask") or not isinstance(v, torch.Tensor):
            continue
        inputs[k] = v[0] if k in PER_TOKEN_INPUTS else v
    return full, new_mask, inputs, image_part


# ---- draft vocabulary ------------------------------------------------------------------------------
def build_draft_vocab(examples, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab_size`` target ids most frequent among the trained tokens, ascending.

    Ties and never-seen ids are taken in id order, so every process builds the same vocabulary.
    """
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary {vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        ids = ex.input_ids[ex.loss_mask]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"row {ex.row} has token id {int(ids.max())} outside the target vocabulary {vocab_size}")
        counts.index_add_(0, ids, torch.ones_like(ids))
    order = torch.argsort(-counts, stable=True)
    chosen = order[:draft_vocab_size]
    total = int(counts.sum())
    if total:
        logger.info("draft vocabulary: %d ids cover %.2f%% of the %d trained tokens",
                    draft_vocab_size, 100.0 * int(counts[chosen].sum()) / total, total)
    return chosen.sort().values


# ---- batches -----------------------------------------------------------------------------------------
def collate(examples: list[Example]) -> dict:
    """Right-padded batch: input_ids (B, T), attention_mask (B, T), loss_mask (B, T) and any per-token tensors;
    with images, ``model_inputs``: the examples' per-image inputs concatenated, per-token ones padded."""
    T = max(ex.input_ids.numel() for ex in examples)
    B = len(examples)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    extra, per_image, per_token = {}, {}, {}
    for b, ex in enumerate(examples):
        n = ex.input_ids.numel()
        ids[b, :n], attn[b, :n], loss[b, :n] = ex.input_ids, 1, ex.loss_mask
        for k, v in ex.tensors.items():
            if k not in extra:
                extra[k] = torch.zeros((B, T) + tuple(v.shape[1:]), dtype=v.dtype)
            extra[k][b, :n] = v
        for k, v in ex.model_inputs.items():
            if k in PER_TOKEN_INPUTS:
                if k not in per_token:
                    per_token[k] = torch.zeros((B, T) + tuple(v.shape[1:]), dtype=v.dtype)
                per_token[k][b, :n] = v
            else:
                per_image.setdefault(k, []).append(v)
    out = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss, **extra}
    if per_image or per_token:
        out["model_inputs"] = {**{k: torch.cat(v) for k, v in per_image.items()}, **per_token}
    return out


@dataclass(frozen=True)
class BatchPlan:
    """Which rows each process reads at each optimizer step; a pure function of the step, for exact resume.

    Each epoch shuffles the rows with a generator seeded by (seed, epoch) and cuts them into micro-batches
    of ``batch_size`` (an incomplete last one is dropped). Optimizer step ``s`` of an epoch uses micro-batches
    ``(s * accum + m) * world + rank`` for m < accum; micro-batches left over at an epoch's end are skipped.
    """

    num_rows: int
    batch_size: int
    world: int
    accum: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return (self.num_rows // self.batch_size) // (self.world * self.accum)

    def check(self) -> None:
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{self.num_rows} rows make {self.num_rows // self.batch_size} micro-batch(es) of batch_size="
                f"{self.batch_size}, fewer than one optimizer step needs ({self.world} process(es) x grad_accum="
                f"{self.accum}); add data or lower batch_size / grad_accum")

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=g).tolist()

    def rows(self, step: int, micro: int, rank: int, order: list[int] | None = None) -> list[int]:
        epoch, s = divmod(step, self.steps_per_epoch)
        order = self.order(epoch) if order is None else order
        b = (s * self.accum + micro) * self.world + rank
        return order[b * self.batch_size:(b + 1) * self.batch_size]
