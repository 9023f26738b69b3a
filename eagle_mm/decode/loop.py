"""speculative_generate: prefill -> draft -> verify -> accept -> update, as a drop-in for ``generate``.

``speculative_generate`` hands its arguments to the target's own ``generate`` with our loop as the
``custom_generate`` callable, so HF prepares everything exactly as for ``generate``: the merged
generation config, special tokens, attention mask, logits processors and stopping criteria
(max length, eos, stop strings, user criteria), and the streamer's prompt. ``custom_generate`` below
is the loop, and is also what ``model.generate(..., custom_generate=eagle_mm.custom_generate,
head=head)`` runs.

The cycle is written once (``_cycle``) over a storage: the engine's fixed buffers (``fixed.FixedStorage``, whose
steps run as CUDA graphs on CUDA) by default, or HF's ``DynamicCache`` (``dynamic.DynamicStorage``), the fallback
``options.choose_storage`` picks, with a logged reason, for what the engine cannot take.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from ..target.parts import resolve_target
from ..config import TreeConfig, bound_tree
from ..target.features import FeatureCapture
from ..target.multimodal import PREFILL_INPUTS, check_images, hide_image_features, image_prompt, rope_offsets, \
    verify_positions
from .chooser import MAX_TOP_K, Session, chooser_for, setting_of
from .draft import DraftSampler, HeadCache, extend_head
from .dynamic import DynamicStorage
from .fixed import FixedStorage
from .options import check_attention, check_generation_config, choose_storage, default_tree, pad_id, \
    resolve_tree, split_model_inputs
from .processors import reads_input_ids, reads_tokens
from .rows import plan
from .skinny import skinny_linears
from .state import DecodeState, SpeculativeOutput, SpeculativeStats
from .stopping import block_stops, first_stop

logger = logging.getLogger(__name__)

__all__ = ["speculative_generate", "custom_generate"]

# The engine keeps one target cache per model and one set of buffers per head: calls on one model take turns.
_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def speculative_generate(model, head, inputs=None, *, tree: TreeConfig | dict | str | None = None,
                         generator: torch.Generator | None = None, autotree_inputs=None,
                         cache_implementation: str | None = None, compile: bool | str | None = None, **kwargs):
    """Drop-in for ``model.generate(inputs, **kwargs)`` with EAGLE tree speculation.

    Greedy output is token-identical to ``generate``; sampling keeps the target's distribution exactly.
    Returns the sequences tensor, or a ``SpeculativeOutput`` (``.sequences``, ``.stats``) when
    ``return_dict_in_generate=True``. ``generator`` seeds sampling (else torch's global RNG).
    ``tree``: a TreeConfig (or a dict of its fields), always drafted as given (``TreeConfig.none()``: no draft, one
    token per target forward); None for the tree the chooser picks (``eagle_mm.decode.chooser``: from the costs
    of the engine's steps, measured once per machine and kept on disk, and the acceptance the head is getting,
    learned from each call; ``TreeConfig.none()`` where no tree pays; picked again when rows finish), reported
    with the expected rates of the finalists in ``stats.choices``; or "auto": the same, its acceptance first
    calibrated by replay on ``autotree_inputs`` (text prompts) or the first prompt row.
    The default call runs the engine: fixed-address buffers and fixed shapes, its steps captured as CUDA graphs on
    CUDA (no compiler; the first call of a shape captures them, later calls replay them) and eager elsewhere.
    ``compile``: True compiles the verify and the update with inductor first (mode "reduce-overhead" on CUDA,
    "default" elsewhere), or a ``torch.compile`` mode name ("max-autotune" modes compile the draft too): slower to
    start, faster per cycle. ``cache_implementation``:
    "dynamic" (or ``compile=False`` alone) runs the fallback loop over HF's ``DynamicCache``; "static" asks for
    the engine. What the engine cannot take falls back with one logged line naming the reason.
    ``stats.time_compile`` holds what the call spent compiling or capturing.
    """
    if "custom_generate" in kwargs:
        raise ValueError("speculative_generate sets custom_generate itself; do not pass it")
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    check_attention(model)
    parts = resolve_target(model)
    _check_prompt(ids, kwargs.get("attention_mask"), parts.vocab_size)
    if parts.is_vlm:
        check_images(parts, model.config, ids, kwargs)
    # generate() hands a custom_generate callable neither the streamer nor the tokenizer: pass the
    # streamer under our own name and turn stop strings into a stopping criterion here.
    streamer = kwargs.pop("streamer", None)
    _stop_strings_to_criteria(model, kwargs)
    resolve_tree(tree)  # fail before generate() does any work
    choose_storage(cache_implementation, compile, None, None, ())
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


def _check_prompt(ids, mask, vocab_size: int) -> None:
    """Fail early with the shapes and values, before generate() fails deep inside with an index error."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or 0 in ids.shape:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a non-empty (batch, length) tensor, got {got}")
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


def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                    streamer=None, head=None, tree=None, generator=None, eagle_streamer=None, autotree_inputs=None,
                    eagle_cache_implementation=None, eagle_compile=None, **model_kwargs):
    """The speculative loop in the signature of transformers' ``custom_generate`` callables.

    ``model.generate(..., custom_generate=eagle_mm.custom_generate, head=head)`` runs it. transformers
    does not pass ``streamer`` to such callables: stream with ``eagle_streamer=`` on that route, and choose the
    storage with ``eagle_cache_implementation=`` / ``eagle_compile=`` (see ``speculative_generate``).
    """
    if eagle_streamer is not None:
        streamer = eagle_streamer
        streamer.put(input_ids.cpu())
    if head is None:
        raise ValueError("custom_generate needs a draft head: model.generate(..., custom_generate=..., head=head)")
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by speculative decoding")
    gen = generation_config
    check_generation_config(gen)
    check_attention(model)
    parts = resolve_target(model)
    mask, position_ids, extra = split_model_inputs(input_ids, model_kwargs, PREFILL_INPUTS if parts.is_vlm else ())
    images = image_prompt(parts, model.config, input_ids, extra) if parts.is_vlm else None
    tree, B, new = resolve_tree(tree), input_ids.shape[0], gen.max_length - input_ids.shape[1]
    head.attach(model)
    vd = getattr(head.config, "draft_vocab_size", None) or head.config.vocab_size
    kind, mode, kinds = choose_storage(eagle_cache_implementation, eagle_compile, model, parts, logits_processor,
                                       device=input_ids.device)
    # ---- the tree: the user's, or the chooser's (chooser.py; the fallback storage drafts options.default_tree) --
    if not isinstance(tree, TreeConfig) and new <= 1:  # the prefill's token is all: no cycle, nothing to measure
        tree = TreeConfig.chain(1)  # (a tree all the same: the head reads the prompt as in every drafting call)
    if tree == "auto":  # the chooser, its acceptance first calibrated by replay on text prompts
        _calibrate(model, head, input_ids, mask, images, autotree_inputs, gen)
    if not isinstance(tree, TreeConfig) and kind == "dynamic":
        tree = default_tree(input_ids.device, B, sampled=gen.do_sample)
    if isinstance(tree, TreeConfig):
        tree = bound_tree(tree, new)  # no deeper than what can be committed
        if tree.top_k > vd:
            raise ValueError(f"tree top_k={tree.top_k} exceeds the head's draft vocabulary of {vd} tokens")
    width = tree.top_k if isinstance(tree, TreeConfig) else min(vd, MAX_TOP_K)  # the widest the chooser drafts
    sampler = DraftSampler.from_processors(logits_processor, head, generator, width) if gen.do_sample else None
    # ----
    lock = _model_lock(model) if kind == "fixed" else contextlib.nullcontext()
    # Eager cycles on a CPU: few-row linears as W @ x^T (skinny.py); a compiler chooses its own kernels, and the
    # prefill keeps generate()'s own arithmetic (its first token and features are bit for bit generate()'s).
    eager_cpu = input_ids.device.type == "cpu" and (kind == "dynamic" or mode is None)
    linears = skinny_linears(model, head) if eager_cpu else contextlib.nullcontext()
    with lock, FeatureCapture(parts, head.feature_layers(parts.num_layers),
                              input_embeds=head.reads_images(parts)) as cap:
        session = None
        if not isinstance(tree, TreeConfig):  # measured costs (probed once per machine) and running acceptance
            session = Session.start(chooser_for(model, head), model=model, head=head, cap=cap, kinds=kinds, batch=B,
                                    gen=gen, sampler=sampler, mode=mode, max_depth=new, max_top_k=vd,
                                    shrinks=mode in (None, "graphs"),
                                    mrope=images is not None and images.positions is not None)
            tree = session.tree
        capacity = session.capacity if session is not None else tree
        _check_cache_room(parts, gen.max_length - 1, capacity)  # the last verify is over at most max_length - 2 slots
        stats = SpeculativeStats(accept_counts=[0] * capacity.depth, tree=tree, engine=kind, mode=mode)
        if kind == "fixed":
            store = FixedStorage(model, head, kinds, tree, input_ids.shape[0], input_ids.shape[1],
                                 gen.max_length, mode, sampler, capacity=capacity)
        else:
            store = DynamicStorage(model, head, parts, tree, sampler)
        setup0 = store.setup
        t0 = time.perf_counter()
        state = _prefill(model, head, cap, store, input_ids, mask, position_ids, images, logits_processor, gen,
                         generator, drafts=tree.drafts)
        _commit(state, state.first[:, None].tolist(), stopping_criteria, streamer)
        stats.time_prefill += time.perf_counter() - t0
        with linears:
            while not all(state.finished):
                keep = plan(state.slots, state.finished, store.pow2) if store.compacts else None
                if keep is not None:  # finished rows stop costing: the storage goes on with the others
                    store.compact(keep)
                    state.keep(keep)
                if session is not None:  # the chooser watches each cycle, and picks again when rows finished
                    tree = session.next_tree(store.batch, stats, store.setup)
                    store.set_tree(tree)
                _check_cache_room(parts, store.cur, capacity)
                _cycle(model, head, cap, store, state, tree, gen, logits_processor, stopping_criteria, streamer,
                       sampler, generator, stats)
        stats.time_compile = store.setup - setup0
        if session is not None:
            session.finish(stats, store.setup)
            stats.choices = session.choices
    if streamer is not None:
        streamer.end()
    sequences = _assemble(input_ids, state.generated, pad_id(gen))
    if not gen.return_dict_in_generate:
        return sequences
    return SpeculativeOutput(sequences, stats, _per_step(state.logits), _per_step(state.scores))


def _per_step(rows: list[list[torch.Tensor]] | None):
    """Per-row lists of (V,) rows -> generate()'s tuple of (B, V) per new token (a finished row repeats its last)."""
    if rows is None:
        return None
    width = max(len(r) for r in rows)
    return tuple(torch.stack([r[min(i, len(r) - 1)] for r in rows]) for i in range(width))


def _model_lock(model) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def _calibrate(model, head, input_ids, attention_mask, images, calib_inputs, gen) -> None:
    """tree="auto": the chooser's acceptance for this setting, calibrated by replay on ``calib_inputs``."""
    from .autotree import calibrate_acceptance

    if calib_inputs is None:
        if images is not None and images.num_images:
            raise ValueError("tree='auto' calibrates on text prompts; with images in the prompt pass text-only "
                             "calibration prompts as autotree_inputs=...")
        calib_inputs = [input_ids[0][attention_mask[0].bool()]]  # the first row, without its padding
    with _model_lock(model):  # the chooser's estimates are shared by the calls on this model, which take turns
        calibrate_acceptance(model, head, calib_inputs, chooser_for(model, head).acceptance_for(setting_of(gen)))


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


def _prefill(model, head, cap, store, input_ids, mask, position_ids, images, processors, gen,
             generator, drafts: bool = True) -> DecodeState:
    """The prompt's forward, the first token, and the head's entries for the prompt (``drafts``: the call starts
    with a tree; one without never drafts, ``chooser.Session``, and leaves the head out)."""
    slot_pos = position_ids.masked_fill(mask == 0, -1)  # (B, T)
    extra, model_pos = None, position_ids
    if images is not None:  # a VLM: images (encoded once, here), token types, M-RoPE positions
        extra = images.inputs
        model_pos = images.positions if images.positions is not None else position_ids
    last_logits, feats, ids, slot_pos = store.prefill(cap, input_ids, slot_pos, model_pos, extra)  # T' >= T slots
    if head.hides_image_features(cap.parts):  # the stricter image ablation: zeros at the image positions
        feats = hide_image_features(feats, ids, cap.parts.image_token_id)
    scores = last_logits.float()
    if processors:
        scores = processors(input_ids, scores)
    root = _choose(scores, gen.do_sample, generator)  # (B,)
    head_tokens = torch.cat((ids[:, 1:], root[:, None]), 1)  # entry t pairs feature t with token t+1
    embeds = None
    if cap.keeps_input_embeds:
        # The target's merged embeddings (image features at image positions), shifted like head_tokens.
        embeds = torch.cat((cap.input_embeds()[:, 1:], head.embed(root[:, None]).to(feats.device)), 1)
    if drafts:
        hcache, h_out, h_logits = extend_head(head, None, feats, head_tokens, slot_pos, embeds=embeds)
        h_out, h_logits = h_out[:, -1], h_logits[:, -1]
    else:  # the head's pass over the prompt (draft logits at every position) would serve nothing
        hcache, h_out, h_logits = _idle_head(head, slot_pos)
    store.start(hcache, root, position_ids[:, -1] + 1, h_out, h_logits)
    B = input_ids.shape[0]
    logits = [[r] for r in last_logits.float().cpu()] if gen.output_logits else None
    kept_scores = [[r] for r in scores.cpu()] if gen.output_scores else None
    return DecodeState(prompt=input_ids.tolist(), generated=[[] for _ in range(B)], finished=[False] * B,
                       first=root.cpu(), rope_offsets=rope_offsets(images, position_ids) if images is not None
                       else None, logits=logits, scores=kept_scores)


def _idle_head(head, slot_pos: torch.Tensor):
    """The head's state for a call that never drafts: a cache of one empty slot per prompt slot (B, nkv, S, hd),
    and zeros for the root's output and draft logits."""
    c, p = head.config, next(head.parameters())
    B, S = slot_pos.shape
    k = torch.zeros(B, c.num_key_value_heads, S, c.head_dim, dtype=p.dtype, device=slot_pos.device)
    vocab = getattr(c, "draft_vocab_size", None) or c.vocab_size
    return (HeadCache(k, torch.zeros_like(k), torch.full_like(slot_pos, -1)), k.new_zeros(B, c.hidden_size),
            torch.zeros(B, vocab, device=slot_pos.device))


def _kept_rows(state: DecodeState, path: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor):
    """output_logits / output_scores: the (B, D+1, V) rows at the path's nodes (node j chose committed token j),
    copied out of the verify's output; None when neither was asked for."""
    if state.logits is None and state.scores is None:
        return None
    idx = path[:, :, None].expand(-1, -1, logits.shape[-1])
    return (logits.gather(1, idx).float().cpu() if state.logits is not None else None,
            scores.gather(1, idx).float().cpu() if state.scores is not None else None)


def _commit(state: DecodeState, new_tokens: list[list[int]], criteria, streamer, kept=None) -> None:
    """Append each row's new tokens, up to where generate()'s criteria, asked after every token, stop it.
    new_tokens[i]: the tokens of storage row i (``state.slots``); ``kept``: the (B', K, V) logits and scores behind
    them (output_logits / output_scores), or None."""
    fast = block_stops(criteria, [len(state.prompt[b]) + len(state.generated[b]) for b in state.slots], new_tokens)
    for i, (b, toks) in enumerate(zip(state.slots, new_tokens)):
        if state.finished[b]:
            continue
        if fast is not None:  # generate()'s own criteria: answered for the whole block from the host's lists
            stop = fast[i]
        else:  # one host tensor per row and cycle; the criteria see its prefixes, as generate() would
            seq = torch.tensor(state.prompt[b] + state.generated[b] + toks, dtype=torch.long)[None]
            stop = first_stop(criteria, seq, seq.shape[1] - len(toks))
        taken = toks if stop is None else toks[: stop + 1]
        state.generated[b].extend(taken)
        state.finished[b] = stop is not None
        for rows, part in zip((state.logits, state.scores), kept or ()):
            if rows is not None:
                rows[b].extend(part[i, : len(taken)])
        if streamer is not None and b == 0 and taken:
            streamer.put(torch.tensor(taken))


def _cycle(model, head, cap, store, state: DecodeState, tree_cfg: TreeConfig, gen, processors, criteria, streamer,
           sampler, generator, stats: SpeculativeStats) -> None:
    D = tree_cfg.depth
    t0 = time.perf_counter()
    tree, q_pos, q_nodes = store.draft()  # (B, N+1) each; q_nodes (B, N+1, V) when sampling
    t1 = time.perf_counter()
    # Verify: root + N nodes in one target forward with the tree mask, then the acceptance.
    logits, feats = store.verify(cap, tree, q_pos, verify_positions(q_pos, state.rope_offsets))  # (B, N+1, V|F)
    accept_len, path, bonus, scores = store.accept(tree, logits, q_nodes, processors, _rows(processors, state), D,
                                                   generator)
    kept = _kept_rows(state, path, logits, scores)  # before the next verify reuses the logits' memory
    # Keep the path, extend the head and set the next root on the device, then the cycle's one host read of the
    # accept lengths and new tokens (the engine queues the next draft behind it on CUDA).
    host = store.read(store.update(tree.tokens, q_pos, feats, accept_len, path, bonus)).tolist()  # (B, 1 + D+1)
    t2 = time.perf_counter()
    acc = [r[0] for r in host]  # per storage row
    _count(stats, acc, [state.finished[b] for b in state.slots], tree.size - 1)
    _commit(state, [r[1: r[0] + 2] for r in host], criteria, streamer, kept)
    store.advance(max(acc) + 1)
    t3 = time.perf_counter()
    stats.time_draft += t1 - t0
    stats.time_verify += t2 - t1
    stats.time_other += t3 - t2


def _rows(processors, state: DecodeState) -> list:
    """What the processors read of each storage row: its sequence (B' tensors) if one reads tokens, its length
    (B' ints) if one reads only that (min-length processors: no per-row tensors each cycle), else nothing."""
    if not reads_input_ids(processors):
        return []
    if reads_tokens(processors):
        return [state.row(b) for b in state.slots]
    return [len(state.prompt[b]) + len(state.generated[b]) for b in state.slots]


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
