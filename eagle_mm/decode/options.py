"""Checks on what ``generate`` prepared for our loop: every option takes effect or raises.

HF's ``generate`` merges kwargs into the generation config, builds logits processors and stopping
criteria, and prepares model inputs; the options below are the ones our loop cannot honour.
"""
from __future__ import annotations

import logging

import torch

from ..config import TreeConfig
from .graphs import COMPILE_MODES
from .masks import layer_kinds
from .processors import INPUT_FREE, capturable_warpers

logger = logging.getLogger(__name__)

__all__ = ["check_generation_config", "check_attention", "split_model_inputs", "pad_id", "choose_storage",
           "default_tree", "resolve_tree", "CACHE_IMPLEMENTATIONS"]

CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")

# Generation options that must stay at their default (name -> default, reason).
_UNSUPPORTED = {
    "num_beams": (1, "beam search is not speculative decoding"),
    "num_beam_groups": (1, "beam search is not speculative decoding"),
    "penalty_alpha": (None, "contrastive search is not supported"),
    "dola_layers": (None, "DoLa decoding is not supported"),
    "output_attentions": (False, "attentions are not returned"),
    "output_hidden_states": (False, "hidden states are not returned"),
    "guidance_scale": (None, "classifier-free guidance runs extra target forwards"),
    "prompt_lookup_num_tokens": (None, "another speculative method; use one at a time"),
    "assistant_early_exit": (None, "another speculative method; use one at a time"),
    "cache_implementation": (None, "the loop manages the target's cache itself"),
    "low_memory": (None, "not applicable"),
}

# Model inputs HF prepares that the loop handles itself; anything else is refused by name.
_HANDLED_INPUTS = ("attention_mask", "position_ids", "use_cache", "cache", "past_key_values", "logits_to_keep",
                   "cache_position")


def check_generation_config(gen) -> None:
    for name, (default, why) in _UNSUPPORTED.items():
        value = getattr(gen, name, None)
        harmless = value is None or value == default or (name == "guidance_scale" and value == 1.0)
        if not harmless and not (isinstance(value, (list, tuple, dict)) and not value):
            raise ValueError(f"generation option {name}={value!r} is not supported: {why}")
    if gen.use_cache is False:
        raise ValueError("use_cache=False is not supported: speculative decoding needs the KV cache")
    if (gen.num_return_sequences or 1) > 1 and not gen.do_sample:
        raise ValueError(f"num_return_sequences={gen.num_return_sequences} needs do_sample=True")


def split_model_inputs(input_ids: torch.Tensor, model_kwargs: dict, accepted: tuple[str, ...] = ()):
    """The prompt's attention mask, 1D positions and the ``accepted`` extra inputs from what generate() prepared.

    Returns (mask (B, T), positions (B, T), extra dict). Inputs neither handled here nor accepted are refused by
    name. When ``"position_ids"`` is accepted (M-RoPE targets), generate()'s multi-axis (R, B, T) position ids
    come back in ``extra`` too.
    """
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty (batch, length) tensor, got "
                         f"{None if input_ids is None else tuple(input_ids.shape)}")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("continuing from a filled cache (past_key_values/cache) is not supported")
    extra = {k: v for k, v in model_kwargs.items() if k in accepted and k != "position_ids" and _given(v)}
    refused = sorted(k for k, v in model_kwargs.items()
                     if k not in _HANDLED_INPUTS and k not in accepted and _given(v))
    if refused:
        raise ValueError(f"speculative_generate does not support the model input(s) {refused}")
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if bool((mask[:, -1] == 0).any()):
        raise ValueError("right-padded batch: the last column of attention_mask has zeros; pad on the left "
                         "(tokenizer.padding_side = 'left')")
    given = model_kwargs.get("position_ids")
    if given is not None and tuple(given.shape[-2:]) != tuple(input_ids.shape):
        raise ValueError(f"position_ids shape {tuple(given.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if given is not None and given.dim() == 3 and "position_ids" in accepted:
        extra["position_ids"] = given  # (R, B, T) multi-axis positions, e.g. Qwen2.5-VL's M-RoPE
    # generate()'s positions: count real tokens; padding positions never matter (masked).
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return mask, pos, extra


def _given(value) -> bool:
    """False for inputs generate() fills with an empty placeholder (None, or {} for pre-encoded images)."""
    return value is not None and not (isinstance(value, dict) and not value)


def pad_id(gen) -> int:
    """The token generate() writes after a row has finished."""
    pad = getattr(gen, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.flatten()[0])
    if gen.pad_token_id is not None:
        return int(gen.pad_token_id)
    eos = gen.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return int(eos) if eos is not None else 0


def check_attention(model) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"tree verification needs a 4D float mask, which attn_implementation={impl!r} cannot take; "
                         f"load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")


def resolve_tree(tree):
    """A TreeConfig, "auto", or None (the default for the device and batch, chosen later) from what the user passed
    (``TreeConfig.coerce``: a TreeConfig, a dict of its fields, or "auto")."""
    return None if tree is None else TreeConfig.coerce(tree)


def default_tree(device: torch.device, batch: int, sampled: bool = False) -> TreeConfig:
    """The tree the fallback storage (``dynamic.py``) drafts when the call gave none: the engine's default call
    chooses its own (``chooser.py``), from costs measured there. A CPU computes every verified node (with ``skinny.py``'s linears a forward
    of 3-4 tokens costs about 1.4x one of 1 on this project's 2-core machine), so it gets a short chain, and when
    sampling, where a draft's later tokens are accepted less often, two levels of two candidates (code-tiny, T=0.8:
    1.13x ``generate`` against the chain's 0.97x); on a GPU a wide tree is free while the target is memory-bound,
    which larger batches end. Sampling on a GPU drafts four levels: each level costs a head forward and the
    proposal's sampling kernels, and the levels past the fourth were almost never accepted (H200, code-tiny, 64
    tokens, T=1 and T=0.8 with top-p 0.95: depth 6 took 26.8 cycles and depth 4 26.0; against the greedy trees,
    depth 4, 6 candidates, 24 nodes ran 1.36x and 1.22x faster at batch 1, and depth 4, 4 candidates, 16 nodes
    1.17x and 1.23x at batch 4 (1.03x on the validation prompts at 128 tokens, where depths 3 to 5 tied):
    ``dev/results/sampled_trees_h200_2026-12-02.json``)."""
    if torch.device(device).type == "cpu":
        return TreeConfig(depth=2, top_k=2, total_tokens=3) if sampled else TreeConfig.chain(3)
    if batch <= 2:
        return TreeConfig(depth=4, top_k=6, total_tokens=24) if sampled else TreeConfig()
    if batch <= 8:
        return TreeConfig(depth=4 if sampled else 5, top_k=4, total_tokens=16)
    return TreeConfig(depth=4, top_k=2, total_tokens=6)


def choose_storage(cache_implementation, compile, model, parts, processors, *, device=None):
    """("fixed" | "dynamic", mode, layer kinds or None): where the call runs and how its steps run.

    The engine ("fixed") unless asked for the fallback (``cache_implementation="dynamic"``, or ``compile=False``
    alone) or the call is one the engine cannot take, which is logged with its reason. mode (engine): None eager,
    "graphs" (CUDA graphs of the eager steps, the default on CUDA) or a ``torch.compile`` mode. With ``model``
    None only the options are checked.
    """
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation={cache_implementation!r} is not supported; expected one of "
                         f"{CACHE_IMPLEMENTATIONS[1:]} (or None for the default, the engine)")
    if compile not in (None, True, False) and (not isinstance(compile, str) or compile not in COMPILE_MODES):
        raise ValueError(f"compile={compile!r}: expected None, True, False or a torch.compile mode {COMPILE_MODES}")
    if compile not in (None, False) and cache_implementation == "dynamic":
        raise ValueError(f"compile={compile!r} needs the engine's fixed shapes; cache_implementation='dynamic' "
                         f"has none: drop one of the two")
    if model is None:
        return None
    if cache_implementation == "dynamic" or (compile is False and cache_implementation is None):
        return "dynamic", None, None
    reason = _engine_refuses(model, parts, processors)
    if reason is not None:
        logger.warning("speculative_generate runs the dynamic-cache fallback: %s", reason)
        return "dynamic", None, None
    cuda = torch.device(device).type == "cuda"
    if compile is None or compile is False:
        mode = "graphs" if cuda and compile is None else None
    elif compile is True:
        mode = "reduce-overhead" if cuda else "default"
    else:
        mode = compile if cuda or compile not in ("reduce-overhead", "max-autotune") else "default"
    return "fixed", mode, layer_kinds(parts.text_config, parts.num_layers)


def _engine_refuses(model, parts, processors) -> str | None:
    """Why the engine cannot take this call, or None."""
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        return f"the target is split over devices {sorted(devices)}, and the engine's graphs run on one device"
    try:
        layer_kinds(parts.text_config, parts.num_layers)
    except ValueError as e:
        return str(e)
    # A subclass of a warper joins the draft's warpers (isinstance), whose code runs inside the draft's graph.
    odd = [type(p).__name__ for p in processors or [] if isinstance(p, INPUT_FREE) and not capturable_warpers([p])]
    if odd:
        return (f"logits processor(s) {odd} subclass a transformers warper, which the engine's draft step runs "
                f"inside its graph; only transformers' own warpers are run there")
    return None
