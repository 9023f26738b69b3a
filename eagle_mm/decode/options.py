"""The call's arguments and settings: every option takes effect or raises.

HF's ``generate`` merges kwargs into the generation config, builds logits processors and stopping
criteria, and prepares model inputs; the options below are the ones our loop cannot honour. The tree and how the
steps run (``choose_mode``) are settled here too.
"""
from __future__ import annotations

import logging

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from ..config import TreeConfig
from ..hf.generation import attention_implementation, placement_devices
from ..hf.streamer import generate_streamer
from .runner import COMPILE_MODES, CUDA_GRAPH_MODES

logger = logging.getLogger(__name__)

__all__ = ["check_head", "check_prompt", "call_streamer", "stop_strings_to_criteria", "check_generation_config",
           "check_attention", "split_model_inputs", "choose_mode", "resolve_tree", "check_cache_room", "CACHE_IMPLEMENTATIONS"]

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


def stop_strings_to_criteria(model, kwargs: dict) -> None:
    """generate()'s ``stop_strings`` (with ``tokenizer``) in ``kwargs`` as a stopping criterion, in place: generate()
    hands a ``custom_generate`` callable no tokenizer."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config") or model.generation_config
    stop = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if not stop:
        return
    if tokenizer is None:
        raise ValueError(f"stop_strings={stop!r} needs the tokenizer: pass tokenizer=... as to generate()")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop))
    kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None


def check_head(head) -> None:
    if head is None:
        raise ValueError("no draft head given: speculative_generate(model, head, ...), or model.generate(..., "
                         "custom_generate=eagle_mm.custom_generate, head=head)")
    if not (callable(getattr(head, "attach", None)) and callable(getattr(head, "step", None))):
        raise TypeError(f"head must be an EagleHead/Eagle3Head, got {type(head).__name__}: load a draft head with "
                        f"eagle_mm.load_head(path, target=model) (or make one with Eagle3Head.from_target(model))")


def check_prompt(ids, mask, vocab_size: int) -> None:
    """Fail early with the shapes and values, before generate() fails deep inside with an index error."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or 0 in ids.shape:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a non-empty (batch, length) tensor, got {got}")
    for name, t in (("input_ids", ids), ("attention_mask", mask)):
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(f"{name} is on the meta device, which holds no data: pass a tensor of real values, on "
                             f"the model's device")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids hold token ids in [{low}, {high}], outside the target's vocabulary "
                         f"[0, {vocab_size}): encode the prompt with the target's own tokenizer")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(ids.shape)}")
    empty = [] if mask is None else (~mask.bool().any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt row(s) {empty} are empty (attention_mask all 0); give each row at least one token")


def call_streamer(model, eagle_streamer, input_ids: torch.Tensor):
    """The call's streamer: ``speculative_generate``'s (``eagle_streamer``, sent the prompt here) or the one given to
    ``model.generate`` (which sent it the prompt itself). A streamer shows one sequence: a batch is refused."""
    given = generate_streamer(model)
    if given is not None and eagle_streamer is not None:
        raise ValueError("both streamer= and eagle_streamer= were given; pass one streamer (streamer=)")
    streamer = given if given is not None else eagle_streamer
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(f"streamer= shows one sequence, but this call decodes {input_ids.shape[0]} rows (prompts "
                         f"times num_return_sequences); stream one prompt per call, or drop streamer=")
    if eagle_streamer is not None:
        eagle_streamer.put(input_ids.cpu())
    return streamer


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


def check_attention(model) -> None:
    impl = attention_implementation(model.config) or "eager"
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"tree verification needs a 4D float mask, which attn_implementation={impl!r} cannot take; "
                         f"load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")


def resolve_tree(tree):
    """A TreeConfig, "auto", or None (the chooser's, ``chooser.py``) from what the user passed
    (``TreeConfig.coerce``: a TreeConfig, a dict of its fields, or "auto")."""
    return None if tree is None else TreeConfig.coerce(tree)


def choose_mode(cache_implementation, compile, model=None, *, device=None) -> str | None:
    """How the call's steps run (``runner.py``): None eagerly, "graphs" (CUDA graphs of the eager steps, the default
    on CUDA) or a ``torch.compile`` mode. Every call runs the engine's one storage; ``cache_implementation="dynamic"``
    or ``compile=False`` ask for eager steps. A call whose steps cannot be captured (a target split over devices:
    a captured step runs on one) runs them eagerly, with one logged line naming the reason. With ``model`` None only
    the options are checked."""
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation={cache_implementation!r} is not supported; expected one of "
                         f"{CACHE_IMPLEMENTATIONS[1:]} (or None for the default)")
    if compile not in (None, True, False) and (not isinstance(compile, str) or compile not in COMPILE_MODES):
        raise ValueError(f"compile={compile!r}: expected None, True, False or a torch.compile mode {COMPILE_MODES}")
    if compile not in (None, False) and cache_implementation == "dynamic":
        raise ValueError(f"compile={compile!r} compiles the engine's fixed-shape steps; cache_implementation='dynamic' "
                         f"asks for eager steps: drop one of the two")
    cuda = device is not None and torch.device(device).type == "cuda"
    if compile is False or cache_implementation == "dynamic":
        mode = None
    elif compile is None:
        mode = "graphs" if cuda else None
    elif compile is True:
        mode = "reduce-overhead" if cuda else "default"
    else:
        mode = compile if cuda or compile not in CUDA_GRAPH_MODES else "default"
    devices = placement_devices(model) if mode is not None and model is not None else []
    if len(devices) > 1:
        logger.warning("speculative_generate runs its steps eagerly (mode=%r asked for): the target is split over "
                       "devices %s, and a captured step runs on one device", mode, devices)
        return None
    return mode


def check_cache_room(parts, length: int, tree: TreeConfig) -> None:
    """A verify forward over ``length`` cached slots must stay below the target's position limit, if it has one
    (Llama 4, see ``TargetParts.position_limit``). Checked on max_length up front, then per cycle on the cache,
    which batches lengthen past their positions with holes."""
    limit = parts.position_limit
    if limit is not None and length + tree.total_tokens + 1 > limit:
        raise ValueError(f"{parts.model_type}: a tree of {tree.total_tokens} tokens over a cache of {length} "
                         f"reaches past {limit} cache entries, where the target's attention temperature tuning "
                         f"(floor_scale {parts.text_config.floor_scale}) reads positions from the cache length, "
                         f"which a verified tree does not follow; lower max_length, the tree or the batch")
