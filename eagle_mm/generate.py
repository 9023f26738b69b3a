"""speculative_generate: prefill -> draft -> verify -> accept -> update, as a drop-in for ``generate``.

``speculative_generate`` hands its arguments to the target's own ``generate`` with our loop as the
``custom_generate`` callable, so HF prepares everything exactly as for ``generate``: the merged
generation config, special tokens, attention mask, logits processors and stopping criteria
(max length, eos, stop strings, user criteria), and the streamer's prompt. ``custom_generate`` below
is the loop, and is also what ``model.generate(..., custom_generate=eagle_mm.custom_generate,
head=head)`` runs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from .arch import resolve_target
from .cache import CacheSnapshot, SlotBook, build_masks, keep_path, layer_kinds
from .compat import cache_kwarg, output_cache
from .config import TreeConfig
from .draft import DraftSampler, HeadCache, draft_tree, extend_head
from .features import FeatureCapture
from .multimodal import (PREFILL_INPUTS, check_images, hide_image_features, image_prompt, rope_offsets,
                         verify_positions)
from .options import check_generation_config, pad_id, split_model_inputs
from .outputs import SpeculativeOutput, SpeculativeStats
from .processing import process_tree_logits, reads_input_ids
from .sampling import tree_rejection_sample_scores
from .static import StaticTarget, cache_length, compiled, resolve_static_options, static_kinds
from .static_cycle import StaticCycle
from .stopping import first_stop
from .kernels import verify_greedy
from .tree import ancestors, path_indices

logger = logging.getLogger(__name__)

__all__ = ["speculative_generate", "custom_generate"]


@dataclass
class DecodeState:
    """Everything that changes between cycles."""

    cache: object  # the target's HF Cache
    slots: SlotBook  # token position of each target cache slot, per layer kind
    head_cache: HeadCache
    root: torch.Tensor  # (B,) last committed token, not yet in the target cache
    root_pos: torch.Tensor  # (B,) its position
    root_out: torch.Tensor  # (B, H) head output at the entry pairing the previous feature with root
    root_logits: torch.Tensor  # (B, V_draft)
    rope_offsets: torch.Tensor | None  # (3, B) M-RoPE offset of each axis from the text position, else None
    prompt: list[list[int]]  # per row, the (padded) prompt as generate() sees it
    generated: list[list[int]]  # per row, committed new tokens
    finished: list[bool]
    target: StaticTarget | None = None  # cache_implementation="static": the target's static cache and verify
    step: object = None  # the head's step function for the sampling draft (compiled or not); None: head.step
    fast: StaticCycle | None = None  # static: the draft (greedy) and the update as one function (graph) each

    def row(self, b: int) -> torch.Tensor:
        return torch.tensor(self.prompt[b] + self.generated[b], dtype=torch.long)


def speculative_generate(model, head, inputs=None, *, tree: TreeConfig | str | None = None,
                         generator: torch.Generator | None = None, autotree_inputs=None,
                         cache_implementation: str | None = None, compile: bool | str | None = None, **kwargs):
    """Drop-in for ``model.generate(inputs, **kwargs)`` with EAGLE tree speculation.

    Greedy output is token-identical to ``generate``; sampling keeps the target's distribution exactly.
    Returns the sequences tensor, or a ``SpeculativeOutput`` (``.sequences``, ``.stats``) when
    ``return_dict_in_generate=True``. ``generator`` seeds sampling (else torch's global RNG).
    ``tree``: a TreeConfig, None for TreeConfig(), or "auto": ``eagle_mm.autotree.choose_tree`` calibrates on
    ``autotree_inputs`` (text prompts) or the first prompt row, on every call; run it once and pass its
    ``.tree`` to decode many prompts.
    ``cache_implementation``: None/"dynamic" (HF ``DynamicCache``, shapes follow the cache) or "static": a
    preallocated HF ``StaticLayer`` cache and fixed shapes, so that a cycle runs as three compiled graphs (draft,
    verify, update: ``eagle_mm/static_cycle.py``). ``compile`` (static only): None compiles on CUDA with
    mode "reduce-overhead" (CUDA graphs), as ``generate`` does with a static cache; True compiles on any device
    (CUDA graphs on CUDA, mode "default" elsewhere); False never; or a ``torch.compile`` mode name. The first
    call compiles (slow); later calls with the same batch size and a cache of the same rounded length reuse the
    graphs. Tokens equal the dynamic path's.
    """
    if "custom_generate" in kwargs:
        raise ValueError("speculative_generate sets custom_generate itself; do not pass it")
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    _check_prompt(ids, kwargs.get("attention_mask"))
    _check_attention(model)
    parts = resolve_target(model)
    if parts.is_vlm:
        check_images(parts, model.config, ids, kwargs)
    # generate() hands a custom_generate callable neither the streamer nor the tokenizer: pass the
    # streamer under our own name and turn stop strings into a stopping criterion here.
    streamer = kwargs.pop("streamer", None)
    _stop_strings_to_criteria(model, kwargs)
    resolve_static_options(cache_implementation, compile)  # fail before generate() does any work
    return model.generate(inputs, custom_generate=custom_generate, head=head, tree=tree, generator=generator,
                          eagle_streamer=streamer, autotree_inputs=autotree_inputs,
                          eagle_cache_implementation=cache_implementation, eagle_compile=compile, **kwargs)


def _stop_strings_to_criteria(model, kwargs: dict) -> None:
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


def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                    streamer=None, head=None, tree=None, generator=None, eagle_streamer=None, autotree_inputs=None,
                    eagle_cache_implementation=None, eagle_compile=None, **model_kwargs):
    """The speculative loop in the signature of transformers' ``custom_generate`` callables.

    ``model.generate(..., custom_generate=eagle_mm.custom_generate, head=head)`` runs it. transformers
    does not pass ``streamer`` to such callables: stream with ``eagle_streamer=`` on that route, and choose the
    cache with ``eagle_cache_implementation=`` / ``eagle_compile=`` (see ``speculative_generate``).
    """
    static, mode = resolve_static_options(eagle_cache_implementation, eagle_compile)
    if eagle_streamer is not None:
        streamer = eagle_streamer
        streamer.put(input_ids.cpu())
    if head is None:
        raise ValueError("custom_generate needs a draft head: model.generate(..., custom_generate=..., head=head)")
    tree = tree if tree is not None else TreeConfig()
    if not isinstance(tree, TreeConfig) and not (isinstance(tree, str) and tree == "auto"):
        raise TypeError(f"tree must be a TreeConfig, None or 'auto', got {type(tree).__name__} {tree!r}")
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by speculative decoding")
    if mode == "auto":
        mode = "reduce-overhead" if input_ids.device.type == "cuda" else None
    elif eagle_compile is True and input_ids.device.type != "cuda":
        mode = "default"  # True = compile the best way here: CUDA graphs ("reduce-overhead") exist on CUDA only
    gen = generation_config
    check_generation_config(gen)
    _check_attention(model)
    parts = resolve_target(model)
    attention_mask, position_ids, extra = split_model_inputs(input_ids, model_kwargs,
                                                             PREFILL_INPUTS if parts.is_vlm else ())
    if static and parts.is_vlm:
        raise ValueError(f"cache_implementation='static' supports text-only targets; {parts.model_type} is a "
                         f"vision-language model: use the dynamic cache")
    images = image_prompt(parts, model.config, input_ids, extra) if parts.is_vlm else None
    autotree = None
    if isinstance(tree, str):
        tree, autotree = _auto_tree(model, head, input_ids, attention_mask, images, autotree_inputs)
    _check_cache_room(parts, gen.max_length - 1, tree)  # the last verify is over at most max_length - 2 slots
    head.attach(model)
    vd = getattr(head.config, "draft_vocab_size", None) or head.config.vocab_size
    if tree.top_k > vd:
        raise ValueError(f"tree top_k={tree.top_k} exceeds the head's draft vocabulary of {vd} tokens")
    sampler = DraftSampler.from_processors(logits_processor, head, generator) if gen.do_sample else None
    stats = SpeculativeStats(accept_counts=[0] * tree.depth, tree=tree, autotree=autotree)
    with FeatureCapture(parts, head.feature_layers(parts.num_layers), input_embeds=head.reads_images(parts)) as cap:
        t0 = time.perf_counter()
        target = None
        if static:
            kinds = static_kinds(parts.text_config, parts.num_layers)
            length = cache_length(input_ids.shape[1], gen.max_length, input_ids.shape[0], tree.total_tokens + 1,
                                  tree.depth)
            target = StaticTarget(model, input_ids.shape[0], length, kinds, mode)
        state = _prefill(model, head, cap, input_ids, attention_mask, position_ids, images, logits_processor, gen,
                         generator, target)
        if static:  # the head cache and the root move into buffers at fixed addresses
            state.fast = StaticCycle(head, target, tree, mode)
            state.head_cache = state.fast.start(state.head_cache, state.root, state.root_pos, state.root_out,
                                                state.root_logits)
            b = state.fast.buf
            state.root, state.root_pos, state.root_out, state.root_logits = (b.root, b.root_pos, b.root_out,
                                                                             b.root_logits)
            state.step = compiled(head, "step", head.step, mode) if mode and gen.do_sample else None
        else:
            kinds = layer_kinds(state.cache, parts.text_config)
        _commit(state, state.root[:, None].tolist(), stopping_criteria, streamer)
        stats.time_prefill += time.perf_counter() - t0
        while not all(state.finished):
            _check_cache_room(parts, target.cur if static else state.slots.full.shape[1], tree)
            _cycle(model, head, cap, state, kinds, tree, gen, logits_processor, stopping_criteria, streamer,
                   sampler, generator, stats)
    if streamer is not None:
        streamer.end()
    sequences = _assemble(input_ids, state.generated, pad_id(gen))
    return SpeculativeOutput(sequences, stats) if gen.return_dict_in_generate else sequences


def _check_prompt(ids, mask) -> None:
    """Fail early with the shapes, before generate() fails deep inside with an index error."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or 0 in ids.shape:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a non-empty (batch, length) tensor, got {got}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(ids.shape)}")
    empty = [] if mask is None else (~mask.bool().any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt row(s) {empty} are empty (attention_mask all 0); give each row at least one token")


def _check_attention(model) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"tree verification needs a 4D float mask, which attn_implementation={impl!r} cannot take; "
                         f"load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")


def _auto_tree(model, head, input_ids, attention_mask, images, calib_inputs):
    """tree="auto": the TreeConfig ``choose_tree`` predicts fastest here, and its report."""
    from .autotree import choose_tree  # imported here: autotree runs speculative_generate to time the loop

    if calib_inputs is None:
        if images is not None and images.num_images:
            raise ValueError("tree='auto' calibrates on text prompts; with images in the prompt pass text-only "
                             "calibration prompts as autotree_inputs=...")
        calib_inputs = [input_ids[0][attention_mask[0].bool()]]  # the first row, without its padding
    result = choose_tree(model, head, calib_inputs, batch_size=input_ids.shape[0])
    logger.debug("tree='auto' candidates:\n%s", result.table())
    return result.tree, result


def _check_cache_room(parts, length: int, tree: TreeConfig) -> None:
    """A verify forward over ``length`` cached slots must stay below the target's position limit, if it has one
    (Llama 4, see ``TargetParts.position_limit``). Checked on max_length up front, then per cycle on the cache,
    which batches lengthen past their positions with holes."""
    limit = parts.position_limit
    if limit is not None and length + tree.total_tokens + 1 > limit:
        raise ValueError(f"{parts.model_type}: a tree of {tree.total_tokens} tokens over a cache of {length} "
                         f"reaches past {limit} cache entries, where the target's attention temperature tuning "
                         f"(floor_scale {parts.text_config.floor_scale}) reads positions from the cache length, "
                         f"which a verified tree does not follow; lower max_length, the tree or the batch")


def _choose(scores: torch.Tensor, do_sample: bool, generator) -> torch.Tensor:
    """Next token from processed scores (B, V), as generate() picks it."""
    if not do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _prefill(model, head, cap, input_ids, attention_mask, position_ids, images, processors, gen,
             generator, target: StaticTarget | None = None) -> DecodeState:
    B = input_ids.shape[0]
    extra, model_pos = {}, position_ids
    if images is not None:  # a VLM: images (encoded once, here), token types, M-RoPE positions
        extra = images.inputs
        model_pos = images.positions if images.positions is not None else position_ids
    if target is not None:
        extra = {**extra, cache_kwarg(model): target.cache}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=model_pos, **extra, use_cache=True)
    feats = cap.features()  # (B, L, F)
    if head.hides_image_features(cap.parts):  # the stricter image ablation: zeros at the image positions
        feats = hide_image_features(feats, input_ids, cap.parts.image_token_id)
    scores = out.logits[:, -1].float()
    if processors:
        scores = processors(input_ids, scores)
    root = _choose(scores, gen.do_sample, generator)  # (B,)
    slot_pos = position_ids.masked_fill(attention_mask == 0, -1)
    head_tokens = torch.cat((input_ids[:, 1:], root[:, None]), 1)  # entry t pairs feature t with token t+1
    embeds = None
    if cap.keeps_input_embeds:
        # The target's merged embeddings (image features at image positions), shifted like head_tokens.
        embeds = torch.cat((cap.input_embeds()[:, 1:], head.embed(root[:, None]).to(feats.device)), 1)
    hcache, h_out, h_logits = extend_head(head, None, feats, head_tokens, slot_pos, embeds=embeds)
    cache = output_cache(out)
    if target is not None:
        target.prefilled(slot_pos)
    return DecodeState(
        cache=cache, slots=SlotBook.after_prefill(cache, slot_pos), head_cache=hcache, root=root,
        root_pos=position_ids[:, -1] + 1, root_out=h_out[:, -1], root_logits=h_logits[:, -1],
        rope_offsets=rope_offsets(images, position_ids) if images is not None else None,
        prompt=input_ids.tolist(), generated=[[] for _ in range(B)], finished=[False] * B, target=target,
    )


def _commit(state: DecodeState, new_tokens: list[list[int]], criteria, streamer) -> None:
    """Append each row's new tokens, up to where generate()'s criteria, asked after every token, stop it."""
    for b, toks in enumerate(new_tokens):
        if state.finished[b]:
            continue
        # One host tensor per row and cycle; the criteria see its prefixes, as generate() would.
        seq = torch.tensor(state.prompt[b] + state.generated[b] + toks, dtype=torch.long)[None]
        stop = first_stop(criteria, seq, seq.shape[1] - len(toks))
        taken = toks if stop is None else toks[: stop + 1]
        state.generated[b].extend(taken)
        state.finished[b] = stop is not None
        if streamer is not None and b == 0 and taken:
            streamer.put(torch.tensor(taken))


def _cycle(model, head, cap, state: DecodeState, kinds, tree_cfg: TreeConfig, gen, processors, criteria, streamer,
           sampler, generator, stats: SpeculativeStats) -> None:
    D = tree_cfg.depth
    t0 = time.perf_counter()
    if state.fast is not None and sampler is None:
        tree, q_pos = state.fast.draft()  # (B, N+1) each, in the static buffers
        q_nodes = None
    else:
        tree, q_nodes = draft_tree(head, state.head_cache, state.root, state.root_out, state.root_logits,
                                   state.root_pos, tree_cfg, sampler=sampler, step=state.step)
        q_pos = state.root_pos[:, None] + tree.depth  # (B, N+1)
    t1 = time.perf_counter()

    # Verify: root + N nodes in one target forward with the tree mask.
    positions = verify_positions(q_pos, state.rope_offsets)
    if state.target is not None:
        target_logits, feats = state.target.verify(cap, tree.tokens, q_pos, tree.parent, D, positions)  # (B, N+1, V|F)
    else:
        masks = build_masks(kinds, state.slots, q_pos, ancestors(tree.parent, D), model.dtype)
        snap = CacheSnapshot(state.cache, tree.size)
        target_logits = model(input_ids=tree.tokens, attention_mask=masks, position_ids=positions,
                              **{cache_kwarg(model): state.cache}, use_cache=True).logits
        feats = cap.features()  # (B, N+1, F)
    rows = [state.row(b) for b in range(len(state.prompt))] if reads_input_ids(processors) else []
    if sampler is None:
        # Greedy: argmax at every node, matched against each child (fused Triton kernel on CUDA).
        logits = process_tree_logits(processors, rows, tree, target_logits, D) if processors else target_logits
        accept_len, best, bonus, path = verify_greedy(logits, tree.tokens, tree.parent, tree.depth, D,
                                                      with_path=True)
    else:
        scores = process_tree_logits(processors, rows, tree, target_logits, D)  # (B, N+1, V) fp32
        # Rejection sampling from the processed logits (kernels.verify_sampling: on CUDA the Triton walk, which
        # softmaxes only the rows it visits; elsewhere the torch walk).
        accept_len, best, bonus = tree_rejection_sample_scores(tree, scores, q_nodes, generator)
        path = path_indices(tree, best, D)  # (B, D+1)
    bonus = bonus[:, None]  # (B, 1)
    if state.fast is not None:
        # Static: keep the path, extend the head and set the next root on the device, before the host read
        # (all D+1 path slots for every row: fixed shapes; the padding past the longest path is overwritten).
        packed = state.fast.update(tree.tokens, q_pos, feats, accept_len, path, bonus)  # (B, 1 + D+1)
    else:
        # New tokens per row: path nodes 1..a, then the bonus at column a.
        j = torch.arange(D + 1, device=path.device)[None]
        path_next = torch.cat((tree.tokens.gather(1, path[:, 1:]), bonus), 1)  # (B, D+1)
        new_tok = torch.where(j == accept_len[:, None], bonus, path_next)
        packed = torch.cat((accept_len[:, None], new_tok), 1)
    # The one host sync of the cycle: accept lengths and new tokens together (static greedy on CUDA: with the
    # next cycle's draft queued behind it, so the GPU drafts while the host commits).
    host = state.fast.read(packed, draft_ahead=sampler is None) if state.fast is not None else packed.cpu()
    t2 = time.perf_counter()

    acc = host[:, 0].tolist()
    _count(stats, acc, state.finished, tree.size - 1)
    _commit(state, [host[b, 1: acc[b] + 2].tolist() for b in range(len(acc))], criteria, streamer)

    A = max(acc) + 1
    if state.fast is not None:
        state.fast.advance(A)
    else:
        # Keep root + accepted nodes in the target cache (A slots for every row; shorter paths padded).
        keep = path[:, :A]  # (B, A)
        valid = j[:, :A] <= accept_len[:, None]  # (B, A)
        new_pos = torch.where(valid, q_pos.gather(1, keep), torch.full_like(keep, -1))
        keep_path(state.cache, snap, state.slots, keep, new_pos, tree.size)
        # Head: entries pairing each kept node's true feature with the next committed token.
        hidden = feats.gather(1, keep[:, :, None].expand(-1, -1, feats.shape[-1]))
        state.head_cache, h_out, h_logits = extend_head(head, state.head_cache, hidden, new_tok[:, :A], new_pos)
        last = accept_len[:, None, None]  # column of the bonus entry
        state.root_out = h_out.gather(1, last.expand(-1, -1, h_out.shape[-1])).squeeze(1)
        state.root_logits = h_logits.gather(1, last.expand(-1, -1, h_logits.shape[-1])).squeeze(1)
        state.root = bonus.squeeze(1)
        state.root_pos = state.root_pos + accept_len + 1
    t3 = time.perf_counter()
    stats.time_draft += t1 - t0
    stats.time_verify += t2 - t1
    stats.time_other += t3 - t2


def _count(stats: SpeculativeStats, acc: list[int], finished: list[bool], n_draft: int) -> None:
    active = [b for b, f in enumerate(finished) if not f]
    stats.num_target_forwards += 1
    stats.num_drafts += len(active)
    stats.num_draft_tokens += len(active) * n_draft
    for b in active:
        stats.accepted_tokens += acc[b] + 1
        for i in range(acc[b]):
            stats.accept_counts[i] += 1


def _assemble(input_ids: torch.Tensor, generated: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(g) for g in generated)
    out = torch.full((input_ids.shape[0], width), pad, dtype=input_ids.dtype)
    for b, g in enumerate(generated):
        out[b, : len(g)] = torch.tensor(g, dtype=input_ids.dtype)
    return torch.cat((input_ids, out.to(input_ids.device)), 1)
