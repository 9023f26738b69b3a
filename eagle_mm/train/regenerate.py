"""Regeneration: a data set's assistant turns replaced by the target's own greedy answers, so that a head learns
to draft text as the target writes it (``TrainConfig.regenerate``).

Answers are generated ``batch_size`` prompts at a time. A conversation's turns go in rounds (round k answers
every row's k-th assistant turn, after the regenerated turns before it); within a round the prompts are sorted
by length and cut into left-padded batches, so that a batch holds prompts of similar length and pads little.
A batch's greedy answers are those of batch 1 up to the rounding of the padded shapes (exact in float32 on the
models tested; in bf16 a near-tie may fall the other way), which is what training data needs.
"""
from __future__ import annotations

import torch

from ..hf.parts import execution_device
from .data import _render, has_images

__all__ = ["regenerate_rows"]


@torch.no_grad()
def regenerate_rows(model, tokenizer, rows: list[tuple[int, dict]], max_new_tokens: int, progress=None, *,
                    batch_size: int = 1) -> list[dict]:
    """Replace every assistant turn by the target's greedy continuation of the conversation before it.

    Text rows are kept as they are. ``progress(n)`` is called as rows are finished, with how many (e.g. a tqdm
    ``update``). ``batch_size``: prompts answered by one ``generate`` call.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    with_images = [n for n, r in rows if has_images(r)]
    if with_images:
        raise ValueError(f"regeneration runs text-only generate(); rows {with_images[:10]} have images: regenerate "
                         f"them elsewhere (e.g. a serving engine) and train on the result")
    source = [row.get("messages") for _, row in rows]
    done = [None if s is None else [] for s in source]  # each conversation as answered so far
    finished = _advance(done, source, range(len(rows)))
    if progress is not None and finished:
        progress(finished)
    while True:
        # This round's prompts: every row whose next message is an assistant turn.
        waiting = [i for i, (d, s) in enumerate(zip(done, source)) if d is not None and len(d) < len(s)]
        if not waiting:
            break
        prompts = [_prompt_ids(tokenizer, done[i], f"row {rows[i][0]}") for i in waiting]
        answers = _answer(model, tokenizer, prompts, max_new_tokens, batch_size)
        for i, text in zip(waiting, answers):
            done[i].append({**source[i][len(done[i])], "content": text})
        finished = _advance(done, source, waiting)
        if progress is not None and finished:
            progress(finished)
    return [{**row, "messages": d} if d is not None else row for (_, row), d in zip(rows, done)]


def _advance(done: list, source: list, rows) -> int:
    """Copy each of ``rows``' messages up to its next assistant turn (which waits for an answer); returns how
    many of them are finished (text rows, and conversations with no assistant turn left)."""
    finished = 0
    for i in rows:
        d, s = done[i], source[i]
        while d is not None and len(d) < len(s) and s[len(d)]["role"] != "assistant":
            d.append(s[len(d)])
        finished += d is None or len(d) == len(s)
    return finished


def _prompt_ids(tokenizer, messages: list[dict], where: str) -> list[int]:
    prompt = _render(tokenizer, messages, where, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False).input_ids


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def _pad_id(model, tokenizer) -> int:
    for value in (tokenizer.pad_token_id, model.generation_config.pad_token_id, *sorted(_eos_ids(model))):
        if value is not None:
            return int(value)
    return 0  # any id: padded positions are masked out and never attended to


def _answer(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> list[str]:
    """The greedy answer to each prompt (token ids), decoded up to the first end-of-sequence token."""
    device = execution_device(model.get_input_embeddings())
    eos, pad = _eos_ids(model), _pad_id(model, tokenizer)
    order = sorted(range(len(prompts)), key=lambda k: (-len(prompts[k]), k))  # longest first: memory peaks early
    answers: list[str] = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(prompts[k]) for k in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, k in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[b, width - len(prompts[k]):] = torch.tensor(prompts[k])
            mask[b, width - len(prompts[k]):] = 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)[:, width:].tolist()  # (B, <= max_new_tokens)
        for b, k in enumerate(chunk):
            gen = out[b]
            cut = next((j for j, t in enumerate(gen) if t in eos), len(gen))
            answers[k] = tokenizer.decode(gen[:cut], skip_special_tokens=True)
    return answers
