"""The end-of-training check: mean acceptance length of a head on held-out prompts, through the real decoder."""
from __future__ import annotations

import dataclasses

import torch

from ..hf.parts import execution_device
from ..config import TreeConfig
from ..decode.loop import speculative_generate
from .data import PER_TOKEN_INPUTS

__all__ = ["eval_prompts", "evaluate", "mean_accept_length"]

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
def evaluate(model, head, prompts, *, max_new_tokens: int, tree: TreeConfig | None = None,
             progress: bool = False) -> dict:
    """The head's acceptance on ``prompts`` through ``speculative_generate``: {"mean_accept_length" (tokens per
    target forward over all prompts, draft-weighted), "prompts", "max_new_tokens", "tree" (what the calls drafted:
    one tree as a dict, or a list of them)}. ``tree``: None drafts ``TreeConfig.reference`` of the target's device, a
    fixed tree, so that heads and runs compare (the default call's chooser adapts its tree to what it has seen).
    ``progress``: a tqdm bar over the prompts."""
    from tqdm.auto import tqdm

    device = execution_device(model.get_input_embeddings())
    tree = tree if tree is not None else TreeConfig.reference(device)
    accepted = drafts = 0
    trees: list[dict] = []
    for prompt in tqdm(prompts, desc="evaluate", unit="prompt", disable=not progress, dynamic_ncols=True):
        inputs = prompt if isinstance(prompt, dict) else {"input_ids": prompt}
        inputs = {k: v.to(device) for k, v in inputs.items()}
        out = speculative_generate(model, head, **inputs, max_new_tokens=max_new_tokens, tree=tree,
                                   return_dict_in_generate=True)
        accepted += out.stats.mean_accept_length * out.stats.num_drafts
        drafts += out.stats.num_drafts
        if dataclasses.asdict(out.stats.tree) not in trees:
            trees.append(dataclasses.asdict(out.stats.tree))
    return {"mean_accept_length": accepted / drafts if drafts else 0.0, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "tree": trees[0] if len(trees) == 1 else trees}


def mean_accept_length(model, head, prompts, *, max_new_tokens: int, tree: TreeConfig | None = None) -> float:
    """``evaluate``'s mean acceptance length alone."""
    return evaluate(model, head, prompts, max_new_tokens=max_new_tokens, tree=tree)["mean_accept_length"]
