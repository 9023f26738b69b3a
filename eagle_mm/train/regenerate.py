"""Regeneration: a data set's assistant turns replaced by the target's own greedy answers, so that a head learns
to draft text as the target writes it (``TrainConfig.regenerate``)."""
from __future__ import annotations

import torch

from ..target.parts import execution_device
from .data import _render, has_images

__all__ = ["regenerate_rows"]


@torch.no_grad()
def regenerate_rows(model, tokenizer, rows: list[tuple[int, dict]], max_new_tokens: int, progress=None) -> list[dict]:
    """Replace every assistant turn by the target's greedy continuation of the conversation before it.

    Text rows are kept as they are. ``progress`` is called once per row (e.g. a tqdm ``update``).
    """
    device = execution_device(model.get_input_embeddings())
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    with_images = [n for n, r in rows if has_images(r)]
    if with_images:
        raise ValueError(f"regeneration runs text-only generate(); rows {with_images[:10]} have images: regenerate "
                         f"them elsewhere (e.g. a serving engine) and train on the result")
    out = []
    for lineno, row in rows:
        if "messages" in row:
            msgs = []
            for m in row["messages"]:
                if m["role"] != "assistant":
                    msgs.append(m)
                    continue
                prompt = _render(tokenizer, msgs, f"row {lineno}", add_generation_prompt=True)
                ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids], device=device)
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False)[0, ids.shape[1]:].tolist()
                cut = next((i for i, t in enumerate(gen) if t in eos), len(gen))
                msgs.append({**m, "content": tokenizer.decode(gen[:cut], skip_special_tokens=True)})
            row = {**row, "messages": msgs}
        out.append(row)
        if progress is not None:
            progress()
    return out
