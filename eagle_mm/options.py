"""Turning ``generate``-style keyword arguments into one validated ``GenerationConfig``.

Every option either takes effect or raises: nothing ``generate`` accepts is silently ignored.
"""
from __future__ import annotations

import copy
import logging

from transformers import GenerationConfig

logger = logging.getLogger(__name__)

__all__ = ["resolve_generation_config", "MODEL_INPUTS"]

# Model inputs (besides input_ids / attention_mask) the loop knows how to pass to the target's prefill.
MODEL_INPUTS: tuple[str, ...] = ()

# Generation options that must stay at their default value (name -> default, reason).
_UNSUPPORTED = {
    "num_beams": (1, "beam search is not speculative decoding"),
    "num_beam_groups": (1, "beam search is not speculative decoding"),
    "num_return_sequences": (1, "repeat the prompt in the batch instead"),
    "penalty_alpha": (None, "contrastive search is not supported"),
    "do_sample": (False, "sampling arrives with exact tree rejection sampling"),
    "output_scores": (False, "per-step scores are not returned"),
    "output_logits": (False, "per-step logits are not returned"),
    "output_attentions": (False, "attentions are not returned"),
    "output_hidden_states": (False, "hidden states are not returned"),
    "repetition_penalty": (1.0, "logits processors are not applied yet"),
    "no_repeat_ngram_size": (0, "logits processors are not applied yet"),
    "encoder_no_repeat_ngram_size": (0, "logits processors are not applied yet"),
    "bad_words_ids": (None, "logits processors are not applied yet"),
    "force_words_ids": (None, "constrained decoding is not supported"),
    "min_length": (0, "logits processors are not applied yet"),
    "min_new_tokens": (None, "logits processors are not applied yet"),
    "suppress_tokens": (None, "logits processors are not applied yet"),
    "begin_suppress_tokens": (None, "logits processors are not applied yet"),
    "sequence_bias": (None, "logits processors are not applied yet"),
    "forced_bos_token_id": (None, "logits processors are not applied yet"),
    "forced_eos_token_id": (None, "logits processors are not applied yet"),
    "guidance_scale": (None, "classifier-free guidance is not supported"),
    "stop_strings": (None, "stop strings are not supported yet"),
    "max_time": (None, "max_time is not supported"),
    "prompt_lookup_num_tokens": (None, "another speculative method; use one at a time"),
    "assistant_early_exit": (None, "another speculative method; use one at a time"),
    "cache_implementation": (None, "the loop manages the target's cache itself"),
    "use_cache": (True, "speculative decoding needs the KV cache"),
    "watermarking_config": (None, "watermarking is not supported"),
    "renormalize_logits": (False, "logits processors are not applied yet"),
    "exponential_decay_length_penalty": (None, "logits processors are not applied yet"),
}

# Keyword arguments of generate() that are not GenerationConfig fields.
_UNSUPPORTED_KWARGS = (
    "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
    "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "past_key_values",
    "cache", "inputs_embeds", "tokenizer", "assistant_tokenizer",
)


def resolve_generation_config(model, generation_config: GenerationConfig | None, kwargs: dict):
    """Merge ``model.generation_config``, ``generation_config`` and kwargs like ``generate`` does.

    Returns (config, model_kwargs): the kwargs that are not generation options (model inputs).
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"speculative_generate does not support the generate() argument {name!r} yet")
    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    gen = copy.deepcopy(base) if base is not None else GenerationConfig()
    model_kwargs = gen.update(**kwargs)
    unknown = [k for k in model_kwargs if k not in MODEL_INPUTS]
    if unknown:
        raise ValueError(f"speculative_generate got unsupported keyword argument(s) {unknown}")
    for name, (default, why) in _UNSUPPORTED.items():
        value = getattr(gen, name, default)
        if name == "do_sample" and value:
            raise NotImplementedError("do_sample=True is not supported yet: " + why)
        if name == "use_cache" and value is False:
            raise ValueError("use_cache=False is not supported: " + why)
        if name not in ("do_sample", "use_cache") and value is not None and value != default and not (
            isinstance(value, (list, dict, tuple)) and not value
        ):
            raise ValueError(f"generation option {name}={value!r} is not supported: {why}")
    return gen, model_kwargs


def eos_ids(gen: GenerationConfig) -> list[int]:
    eos = gen.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def pad_id(gen: GenerationConfig) -> int:
    if gen.pad_token_id is not None:
        return int(gen.pad_token_id)
    eos = eos_ids(gen)
    return eos[0] if eos else 0
