"""What eagle_mm reads of transformers' generation machinery beyond its public API.

The private generation-config fields ``generate`` fills in, the model's attention implementation and device
placement, and the logits processors and stopping criteria whose rules the decode loop applies itself. Those are
matched by exact type (a subclass may answer differently) and their rules read the objects' fields, which
transformers does not document as API: all of that is here.
"""
from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

__all__ = ["pad_token_id", "attention_implementation", "placement_devices", "INPUT_FREE", "LENGTH_ONLY", "ROW_WISE",
           "min_length_rule", "for_row", "SORTED_RULES", "top_k_of", "split_criteria"]


def pad_token_id(gen) -> int:
    """The token generate() writes after a row has finished."""
    pad = getattr(gen, "_pad_token_tensor", None)  # what generate() settled on (from pad or eos), when it ran
    if pad is not None:
        return int(pad.flatten()[0])
    if gen.pad_token_id is not None:
        return int(gen.pad_token_id)
    eos = gen.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return int(eos) if eos is not None else 0


def attention_implementation(config) -> str | None:
    """The attention implementation a model of ``config`` runs ("eager", "sdpa", "flash_attention_2", ...); None for
    a config that names none (a draft head's)."""
    return getattr(config, "_attn_implementation", None)


def placement_devices(model) -> list[str]:
    """The devices a ``device_map`` spread the model over (accelerate's ``hf_device_map``), sorted; [] without one."""
    return sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()})


def _named(*names: str) -> tuple:
    return tuple(getattr(lp, name) for name in names if hasattr(lp, name))


# Processors whose output does not depend on the sequence so far: applied to every tree node at once.
INPUT_FREE = _named("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
                    "SuppressTokensLogitsProcessor", "InfNanRemoveLogitsProcessor", "LogitNormalization")

# Processors that read only the sequence's length: applied to all nodes at once from each node's length.
LENGTH_ONLY = _named("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")

# Processors that read a row's tokens and compute each row from them alone, with no state indexed by row (but a
# repetition penalty's per-row prompt length, which ``for_row`` turns into the row's own).
ROW_WISE = _named("RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor",
                  "NoBadWordsLogitsProcessor", "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
                  "ExponentialDecayLengthPenalty", "SuppressTokensAtBeginLogitsProcessor")


def min_length_rule(p) -> tuple[int, int, torch.Tensor]:
    """A ``LENGTH_ONLY`` processor's rule: (minimum length, prompt length it does not count, eos ids): eos is masked
    while ``length - skip < minimum``."""
    skip = getattr(p, "prompt_length_to_skip", 0)
    minimum = p.min_new_tokens if hasattr(p, "min_new_tokens") else p.min_length
    return minimum, skip, p.eos_token_id


def for_row(processors, b: int, batch: int):
    """The processors as call row b of ``batch`` alone sees them. ``generate`` gives a left-padded batch's repetition
    penalty each row's padding length as a (B,) tensor (``prompt_ignore_length``), whose pad tokens it then leaves
    unpenalized; row b's copy cuts its own padding off instead, which leaves the same tokens unpenalized. A tensor
    of another batch size is left as it is: the penalty then refuses it as it does in ``generate``."""
    pil = [getattr(p, "prompt_ignore_length", None) for p in processors]
    if not any(isinstance(t, torch.Tensor) and t.shape == (batch,) for t in pil):
        return processors
    out = LogitsProcessorList()
    for p, t in zip(processors, pil):
        if type(p) is lp.RepetitionPenaltyLogitsProcessor and isinstance(t, torch.Tensor) and t.shape == (batch,):
            p = copy.copy(p)
            p.prompt_ignore_length = int(t[b])
        out.append(p)
    return out


def _keep_first(values: torch.Tensor, drop: torch.Tensor, n: int) -> torch.Tensor:
    """values with ``drop`` set to -inf, except the first n (the largest: the warpers' min_tokens_to_keep)."""
    drop[..., :n] = False
    return values.masked_fill(drop, float("-inf"))


def _top_p(p, values):
    probs = torch.softmax(values, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
    return _keep_first(values, before >= p.top_p, max(1, p.min_tokens_to_keep))


def _min_p(p, values):
    probs = torch.softmax(values, dim=-1)
    return _keep_first(values, probs < p.min_p * probs[..., :1], max(1, p.min_tokens_to_keep))


def _top_k(p, values):
    out = values.clone()
    out[..., p.top_k:] = float("-inf")  # sorted: the k largest come first
    return out


# transformers' warpers with their rule on values sorted largest first (what the draft's compact proposal applies).
SORTED_RULES = {lp.TemperatureLogitsWarper: lambda p, v: v / p.temperature, lp.TopKLogitsWarper: _top_k,
                lp.TopPLogitsWarper: _top_p, lp.MinPLogitsWarper: _min_p}


def top_k_of(warpers) -> int | None:
    """The smallest top-k that a ``TopKLogitsWarper`` among ``warpers`` keeps, or None."""
    return min((p.top_k for p in warpers if type(p) is lp.TopKLogitsWarper), default=None)


def split_criteria(criteria) -> tuple[list[int], list[torch.Tensor], list, list]:
    """generate()'s stopping criteria by what answers a block of new tokens at once: (max lengths, eos id tensors,
    time limits, the others, which must be asked on every prefix)."""
    lengths, eos, timers, others = [], [], [], []
    for c in criteria or ():
        kind = type(c)  # exact types: a subclass may answer differently
        if kind is MaxLengthCriteria:
            lengths.append(c.max_length)
        elif kind is EosTokenCriteria:
            eos.append(c.eos_token_id)
        elif kind is MaxTimeCriteria:
            timers.append(c)
        else:
            others.append(c)
    return lengths, eos, timers, others
