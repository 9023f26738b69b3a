"""The end-of-training check: mean acceptance length of a head on held-out prompts, through the real decoder."""
from __future__ import annotations

import torch

from ..target.parts import execution_device
from ..config import TreeConfig
from ..decode.loop import speculative_generate
from .data import PER_TOKEN_INPUTS

__all__ = ["eval_prompts", "mean_accept_length"]

_MAX_TEXT_PROMPT = 64


def eval_prompts(examples, limit: int) -> list:
    """(1, L) prompts from held-out examples: a chat row up to its first assistant token, a text row's first half.

    A row with images gives a dict of generate() inputs instead: input_ids and its image inputs (batched).
    """
    prompts = []
    for ex in list(examples)[:limit]:
        trained = ex.loss_mask.nonzero().flatten()
        first = int(trained[0]) if trained.numel() else 0
        if first == 0:  # a text row (trained from its first token): its first half is the prompt
            first = max(1, min(_MAX_TEXT_PROMPT, ex.input_ids.numel() // 2))
        ids = ex.input_ids[None, :first]
        if ex.model_inputs:
            extra = {k: v[None, :first] if k in PER_TOKEN_INPUTS else v for k, v in ex.model_inputs.items()}
            prompts.append({"input_ids": ids, **extra})
        else:
            prompts.append(ids)
    return prompts


@torch.no_grad()
def mean_accept_length(model, head, prompts, *, max_new_tokens: int, tree: TreeConfig | None = None) -> float:
    """Tokens per target forward over all prompts (``SpeculativeStats.mean_accept_length``, draft-weighted), with
    ``tree`` or the wide ``TreeConfig()`` on every device: a measure of the head, not of the device's default."""
    tree = tree if tree is not None else TreeConfig()
    device = execution_device(model.get_input_embeddings())
    accepted = drafts = 0
    for prompt in prompts:
        inputs = prompt if isinstance(prompt, dict) else {"input_ids": prompt}
        inputs = {k: v.to(device) for k, v in inputs.items()}
        out = speculative_generate(model, head, **inputs, max_new_tokens=max_new_tokens, tree=tree,
                                   return_dict_in_generate=True)
        accepted += out.stats.mean_accept_length * out.stats.num_drafts
        drafts += out.stats.num_drafts
    return accepted / drafts if drafts else 0.0
