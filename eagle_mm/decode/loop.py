"""speculative_generate: prefill, then cycles of draft, verify, accept, update, as a drop-in for ``generate``.

``speculative_generate`` hands its arguments to the target's own ``generate`` with our loop as the
``custom_generate`` callable, so HF prepares everything exactly as for ``generate``: the merged
generation config, special tokens, attention mask, logits processors and stopping criteria
(max length, eos, stop strings, user criteria), and the streamer's prompt. ``custom_generate`` below
is the loop, and is also what ``model.generate(..., custom_generate=eagle_mm.custom_generate,
head=head)`` runs.

The loop runs on the decoder of (model, head, device) (``decoder.py``), which keeps the engine's storage and its
captured or compiled steps between calls. ``_cycle`` is one cycle, top to bottom: each step is launched here.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from functools import cache, partial

import torch

from ..config import TreeConfig, bound_tree
from ..hf.generation import pad_token_id
from ..hf.multimodal import PREFILL_INPUTS, check_images, image_prompt, verify_positions
from ..hf.parts import resolve_target
from .accept import accept
from .autotree import calibrate_acceptance
from .chooser import MAX_TOP_K, setting_of
from .session import Session, few_row_linears
from .cost_cache import decode_kind
from .decoder import Decoder, decoder
from .draft import DraftSampler
from .options import call_streamer, check_attention, check_cache_room, check_generation_config, check_head, \
    check_prompt, choose_mode, resolve_tree, split_model_inputs, stop_strings_to_criteria
from .processors import cycle_ops, process_tree_logits
from .skinny import for_rows, skinny_linears
from .prefill import prefill
from .state import Call, DecodeState, PhaseClock, SpeculativeStats
from .sampling import draft_noise, walk_noise
from .stopping import Stops, block_stops, first_stop
from .storage import plan
from .tree import Tree

logger = logging.getLogger(__name__)

__all__ = ["speculative_generate", "custom_generate"]


def speculative_generate(model, head, inputs=None, *, tree: TreeConfig | dict | str | None = None,
                         generator: torch.Generator | None = None, autotree_inputs=None,
                         cache_implementation: str | None = None, compile: bool | str | None = None,
                         profile: bool = False, **kwargs):
    """Drop-in for ``model.generate(inputs, **kwargs)`` with EAGLE tree speculation.

    Greedy output is token-identical to ``generate``; sampling keeps the target's distribution exactly.
    Returns the sequences tensor, or a ``SpeculativeOutput`` (``.sequences``, ``.stats``) when
    ``return_dict_in_generate=True``. ``generator`` seeds sampling (else torch's global RNG); its draws depend on the
    tree, so calls that must repeat their tokens for one seed pass a ``tree``.
    ``tree``: a TreeConfig (or a dict of its fields), always drafted as given (``TreeConfig.none()``: no draft, one
    token per target forward); None for the tree the chooser picks (``eagle_mm.decode.chooser``: from the costs of
    the engine's steps, measured once per machine and kept on disk, and the acceptance the head is getting, learned
    from each call; ``TreeConfig.none()`` where no tree pays; picked again when rows finish), reported with the
    expected rates of the finalists in ``stats.choices``; or "auto": the same, its acceptance first calibrated by
    replay on ``autotree_inputs`` (text prompts) or the first prompt row.
    Every call runs the engine: fixed-address buffers and fixed shapes, kept between calls by the decoder of
    (model, head, device) (``eagle_mm.decoder``), its steps captured as CUDA graphs on CUDA (no compiler; the first
    call of a shape captures them, later calls replay them) and eager elsewhere. ``compile``: True compiles the
    verify and the update with inductor first (mode "reduce-overhead" on CUDA, "default" elsewhere), or a
    ``torch.compile`` mode name ("max-autotune" modes compile the draft too): slower to start, faster per cycle;
    False runs the steps eagerly, as ``cache_implementation="dynamic"`` does ("static": the default). Steps that
    cannot be captured (a target split over devices, subclassed warpers) run eagerly, with one logged line naming
    the reason. ``stats.time_compile`` holds what the call spent compiling or capturing.
    ``profile``: True times each phase of the cycles (draft, verify, accept, update) on the device, with CUDA events
    on CUDA, into ``stats.device_time`` (seconds per phase; the host's share is the cycles' time less their sum).
    """
    if not isinstance(profile, bool):
        raise TypeError(f"profile must be True or False, got {profile!r}")
    if "custom_generate" in kwargs:
        raise ValueError("speculative_generate sets custom_generate itself; do not pass it")
    if kwargs.get("assistant_model") is not None:  # generate() would not pass it on: refused here, by name
        raise ValueError(f"assistant_model={type(kwargs['assistant_model']).__name__} is not supported: "
                         f"speculative_generate drafts with the head; drop assistant_model (model.generate("
                         f"assistant_model=...) runs transformers' assisted generation)")
    check_head(head)
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    check_attention(model)
    parts = resolve_target(model)
    check_prompt(ids, kwargs.get("attention_mask"), parts.vocab_size)
    if parts.is_vlm:
        check_images(parts, model.config, ids, kwargs)
    # generate() hands a custom_generate callable neither the streamer nor the tokenizer: pass the
    # streamer under our own name and turn stop strings into a stopping criterion here.
    streamer = kwargs.pop("streamer", None)
    stop_strings_to_criteria(model, kwargs)
    resolve_tree(tree)  # fail before generate() does any work
    choose_mode(cache_implementation, compile)
    return model.generate(inputs, custom_generate=custom_generate, head=head, tree=tree, generator=generator,
                          eagle_streamer=streamer, autotree_inputs=autotree_inputs,
                          eagle_cache_implementation=cache_implementation, eagle_compile=compile,
                          eagle_profile=profile, **kwargs)


def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                    streamer=None, head=None, tree=None, generator=None, eagle_streamer=None, autotree_inputs=None,
                    eagle_cache_implementation=None, eagle_compile=None, eagle_profile=False, **model_kwargs):
    """The speculative loop in the signature of transformers' ``custom_generate`` callables.

    ``model.generate(..., custom_generate=eagle_mm.custom_generate, head=head)`` runs it, ``streamer=`` included
    (transformers does not pass it to such callables; ``hf.streamer`` reads it from ``generate``), and chooses
    how the steps run with ``eagle_cache_implementation=`` / ``eagle_compile=`` and times the phases with
    ``eagle_profile=`` (see ``speculative_generate``).
    """
    streamer = call_streamer(model, eagle_streamer, input_ids)
    check_head(head)
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by speculative decoding")
    gen = generation_config
    check_generation_config(gen)
    check_attention(model)
    parts = resolve_target(model)
    mask, position_ids, extra = split_model_inputs(input_ids, model_kwargs, PREFILL_INPUTS if parts.is_vlm else ())
    images = image_prompt(parts, model.config, input_ids, extra) if parts.is_vlm else None
    dec = decoder(model, head, input_ids.device)
    head = dec.bind(parts.embed.weight.dtype)  # a copy bound to the target: the caller's head is never changed
    # generate() takes a fractional max_new_tokens (max_length) and stops at the first length past it.
    B, max_length = input_ids.shape[0], math.ceil(gen.max_length)
    new = max_length - input_ids.shape[1]
    mode = choose_mode(eagle_cache_implementation, eagle_compile, model, device=input_ids.device)
    vd = getattr(head.config, "draft_vocab_size", None) or head.config.vocab_size
    tree = resolve_tree(tree)
    if tree == "auto" and new > 1:  # the chooser, its acceptance first calibrated by replay on text prompts
        _calibrate(dec, head, input_ids, mask, images, autotree_inputs, gen)
    tree = _given_tree(tree, new, vd)
    width = tree.top_k if tree is not None else min(vd, MAX_TOP_K)  # the widest the chooser drafts
    sampler = DraftSampler.from_processors(logits_processor, head, generator, width) if gen.do_sample else None
    # Eager cycles on a CPU: the verify's and the update's few-row linears as W @ x^T, in this thread only
    # (skinny.py); a compiler chooses its own kernels, and the prefill keeps generate()'s own arithmetic (its first
    # token and features are bit for bit generate()'s).
    linears = skinny_linears() if input_ids.device.type == "cpu" and mode is None else contextlib.nullcontext()
    with dec.running() as cap:
        t0, session = time.perf_counter(), None
        if tree is None:  # the chooser's: from measured costs (probed once here) and acceptance
            session = Session.start(dec.chooser, model=model, head=head, cap=cap, batch=B, gen=gen, sampler=sampler,
                                    mode=mode, max_depth=new, max_top_k=vd, shrinks=mode in (None, "graphs"),
                                    mrope=images is not None and images.positions is not None)
            tree = session.tree
        # Where a forward of q tokens per row at a batch takes skinny.py's few-row linears: as the probe measured them
        # faster here, for the chooser's trees and a user's alike (a user's tree reads the costs a default call
        # measured on this machine, kept on disk; the verify is the same forward whatever the sampler). Without such
        # a measurement a user's tree runs generate()'s F.linear: taken wherever there were a few rows, the few-row
        # product made code-tiny's one-token decoding at batch 4 1.6-1.8x slower on this project's CPU (2026-12).
        if session is not None:
            few_rows = session.few_row_linears
        else:
            table = isinstance(linears, skinny_linears) and (
                dec.chooser.table(decode_kind(sampler, False, input_ids.device))
                or dec.chooser.table(decode_kind(None, False, input_ids.device)))
            few_rows = partial(few_row_linears, table) if table else _never
        few_rows = cache(few_rows)  # the costs it reads are fixed for the call: each shape is looked up once
        capacity = session.capacity if session is not None else tree  # the largest tree the call may switch to
        check_cache_room(parts, max_length - 1, capacity)  # the last verify is over at most max_length - 2 slots
        stats = SpeculativeStats(accept_counts=[0] * capacity.depth, first_counts=[0] * capacity.depth, tree=tree,
                                 mode=mode)
        call = Call(model=model, head=head, dec=dec, cap=cap, gen=gen, processors=logits_processor,
                    stops=Stops.of(stopping_criteria), streamer=streamer, generator=generator, stats=stats,
                    parts=parts, limit=parts.position_limit, linears=linears, pad=pad_token_id(gen),
                    session=session, new=new, few_rows=few_rows,
                    clock=PhaseClock(input_ids.device) if eagle_profile else None)
        setup0 = dec.setup
        dec.begin(tree, mode, B, input_ids.shape[1], max_length, sampler, capacity=capacity)
        state = prefill(call, input_ids, mask, position_ids, images)
        _commit(call, state, [[t] for t in state.first.tolist()])
        stats.time_prefill += time.perf_counter() - t0
        while not all(state.finished):
            _cycle(call, state)
        stats.time_compile = dec.setup - setup0
        if call.clock is not None:
            stats.device_time = call.clock.totals()
        if session is not None:
            session.finish(stats, dec.setup, max(len(g) for g in state.generated) - 1)
            stats.choices = session.choices
    if streamer is not None:
        streamer.end()
    return state.output(input_ids, call.pad, stats if gen.return_dict_in_generate else None)


def _draft(call: Call) -> None:
    """Launch the draft of the next tree into the decoder's buffers."""
    dec = call.dec
    buf, t = dec.storage.buf, dec.tree
    if not t.drafts:  # the root alone (its parent and depth columns hold 0 from the start)
        buf.tokens[:, 0].copy_(buf.root)
        buf.q_pos[:, 0].copy_(buf.root_pos)
        return
    if dec.sampler is not None:
        draft_noise(buf.noise, dec.generator)  # outside the step: a user's torch.Generator cannot be captured
    dec.runner.draft(call.head, buf, dec.sampler, t.top_k, t.depth, t.total_tokens)
    if call.clock is not None:  # profile=True (without a tree the root's copy above is the verify's input: its span)
        call.clock.mark("draft")


def _cycle(call: Call, state: DecodeState) -> None:
    """One cycle, top to bottom: drop finished rows, choose the tree, draft, verify, the processors, accept, update,
    read, commit."""
    dec, stats, clock = call.dec, call.stats, call.clock
    run, store = dec.runner, dec.storage
    ts = time.perf_counter()
    if state.shrink:  # rows finished: the storage goes on with the others (compiled runs keep their batch)
        _drop_finished(call, state)
    if call.session is not None:  # the chooser watches each cycle, and picks again when rows finished
        _next_tree(call, state)
    t = dec.tree
    Q = t.total_tokens + 1
    if store.cur + Q > store.length:  # the engine's cache grows as the rows commit tokens
        dec.reserve()
        if call.session is not None:
            call.session.moved(store.generation)
    if call.limit is not None:
        check_cache_room(call.parts, store.cur, t)
    t0 = time.perf_counter()
    if clock is not None:
        clock.begin()
    if not state.drafted:  # else the previous cycle launched this cycle's draft ahead
        _draft(call)
    t1 = time.perf_counter()
    buf = store.buf  # the tree (B, Q) is in the buffers
    positions = buf.q_pos if state.rope_offsets is None else verify_positions(buf.q_pos, state.rope_offsets)
    write = torch.arange(store.cur, store.cur + Q, device=buf.q_pos.device)  # the tree's slots
    with _linears(call, store.batch, Q):
        logits, feats = run.verify(call.model, store.in_use(store.cur + Q), buf, call.cap, write, positions, t.depth)
    if clock is not None:
        clock.mark("verify")
    # The processors as one step with the acceptance where the host can say what they do at every node this cycle
    # (input-free warpers; a minimum length that masks EOS at all nodes or none): captured on CUDA, one graph instead
    # of ~20 eager launches a cycle (code-tiny's no-tree step at 64 rows: 0.6 ms of host time, a third of its step).
    # Greedy without processors keeps its acceptance eager (the kernel's two launches): captured, the 8B-shaped
    # cycle of bench_8b took 0.95 ms longer on two H100s (13.92 against 12.97 ms; cause not found).
    ops = cycle_ops(call.processors, dec.sampler.warpers if dec.sampler is not None else (), state.lengths, t.depth,
                    logits.device, call.eos)
    if ops is not None and (ops or dec.sampler is not None):
        if dec.sampler is not None:
            walk_noise(buf.u, buf.e, dec.generator)  # outside the step, like the draft's
        accept_len, path, bonus, scores = run.accept(buf, logits, dec.sampler is not None, t.depth, ops)
    else:  # greedy whose processors do nothing this cycle (ops ()), or processors that read the tokens (or a minimum
        # some nodes reach): eagerly
        tree = Tree(buf.tokens, buf.parent, buf.depth)
        scores = logits if ops is not None else \
            process_tree_logits(call.processors, state.call_rows(call.processors, call.pad), tree, logits, t.depth)
        accept_len, path, bonus = accept(tree, scores, buf.q_nodes, t.depth, call.generator)
    # output_logits / output_scores: copied out before the next verify reuses the logits' memory
    kept = _kept_rows(state, path, logits, scores) if state.logits is not None or state.scores is not None else None
    if clock is not None:
        clock.mark("accept")
    t2 = time.perf_counter()
    # Keep the path, extend the head and set the next root on the device, then start the cycle's one host read of
    # the accept lengths and new tokens.
    if t.drafts:
        with _linears(call, store.batch, t.depth + 1):
            packed = run.update(call.head, store.target, buf, feats, accept_len, path, bonus)  # (B, 2 + D+1)
    else:  # no tree: the root's slot kept, the next root set, the head left as it is (no linear: no mode)
        packed = run.advance(store.target, buf, bonus)  # (B, 3)
    host = store.read(packed)
    if clock is not None:
        clock.mark("update")
    t3 = time.perf_counter()
    state.drafted = dec.overlaps  # CUDA: the next draft runs on the device while the host commits
    if state.drafted:
        _draft(call)
    t4 = time.perf_counter()
    if state.drafted:
        store.wait()  # for the copy only, not for the draft queued after it
    host = host.tolist()  # one host list per cycle: the rows' accept lengths, first choices and new tokens
    acc = [r[0] for r in host]  # per storage row
    live = [r for r, b in zip(host, state.slots) if not state.finished[b]]
    stats.count([r[0] for r in live], Q - 1, [r[1] for r in live])
    _commit(call, state, [r[2: r[0] + 3] for r in host], kept)
    store.cur += max(acc) + 1  # the host's copy of the write pointer, as update_step moved the device's
    stats.time_draft += t1 - t0 + t4 - t3
    stats.time_verify += t2 - t1
    stats.time_other += t0 - ts + t3 - t2 + time.perf_counter() - t4  # dropping rows and choosing the tree too


def _linears(call: Call, batch: int, q: int):
    """The context a forward of ``q`` tokens per row at ``batch`` rows runs in: ``skinny.py``'s few-row linears on a
    CPU where the probe measured them faster (``Call.few_rows``), else none."""
    return for_rows(call.linears, batch * q) if call.few_rows(batch, q) else contextlib.nullcontext()


def _never(batch: int, q: int) -> bool:
    """``Call.few_rows`` where nothing says the few-row linears pay."""
    return False


def _drop_finished(call: Call, state: DecodeState) -> None:
    """Go on with the rows that have not finished (``storage.plan``; compiled runs keep their batch, and a captured
    call where the chooser finds a new capture would cost more than the fewer rows save)."""
    mode = call.dec.runner.mode
    keep = plan(state.slots, state.finished, mode == "graphs") if mode in (None, "graphs") else None
    if keep is not None and call.session is not None:
        keep = keep if call.session.shrink_pays(call.dec.storage.batch, len(keep), _left(call, state)) else None
    if keep is not None:
        call.dec.storage.compact(keep)
        state.keep(keep)
    state.shrink = False


def _next_tree(call: Call, state: DecodeState) -> None:
    """The chooser's tree for the next cycle: it observes the last cycle in ``stats``, then keeps its tree or picks
    another (a smaller batch, a moved estimate)."""
    dec = call.dec
    tree = call.session.next_tree(dec.storage.batch, call.stats, dec.setup, _left(call, state), dec.storage.generation)
    if tree != dec.tree:
        dec.set_tree(tree)
        state.drafted = False  # a draft launched ahead was the other tree's


def _left(call: Call, state: DecodeState) -> int:
    """New tokens per row the call may still decode: its most, less what its shortest live row has."""
    return call.new - min(len(state.generated[b]) for b in state.slots if not state.finished[b])


def _given_tree(tree, new: int, vd: int) -> TreeConfig | None:
    """The call's TreeConfig (the user's, no deeper than the ``new`` tokens it can commit), or None for the chooser's
    (``tree`` None or "auto"); ``vd``: the head's draft vocabulary."""
    if not isinstance(tree, TreeConfig):
        if new > 1:
            return None
        tree = TreeConfig.chain(1)  # the prefill's token is all: no cycle, nothing to choose
    tree = bound_tree(tree, new)
    if tree.top_k > vd:
        raise ValueError(f"tree top_k={tree.top_k} exceeds the head's draft vocabulary of {vd} tokens")
    return tree


def _calibrate(dec: Decoder, head, input_ids, attention_mask, images, calib_inputs, gen) -> None:
    """tree="auto": the chooser's acceptance for this setting, calibrated by replay on ``calib_inputs``."""
    if calib_inputs is None:
        if images is not None and images.num_images:
            raise ValueError("tree='auto' calibrates on text prompts; with images in the prompt pass text-only "
                             "calibration prompts as autotree_inputs=...")
        calib_inputs = [input_ids[0][attention_mask[0].bool()]]  # the first row, without its padding
    with dec.lock:  # the chooser's estimates are shared by the calls on this decoder, which take turns
        calibrate_acceptance(dec.model, head, calib_inputs, dec.chooser.acceptance_for(setting_of(gen)))


def _kept_rows(state: DecodeState, path: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor):
    """output_logits / output_scores: the (B, D+1, V) rows at the path's nodes (node j chose committed token j),
    copied out of the verify's output."""
    idx = path[:, :, None].expand(-1, -1, logits.shape[-1])
    return (logits.gather(1, idx).float().cpu() if state.logits is not None else None,
            scores.gather(1, idx).float().cpu() if state.scores is not None else None)


def _commit(call: Call, state: DecodeState, new_tokens: list[list[int]], kept=None) -> None:
    """Append each row's new tokens, up to where generate()'s criteria, asked after every token, stop it.
    Storage row i (``state.slots``) commits ``new_tokens[i]``; ``kept``: the (B', K, V) logits and scores behind them
    (output_logits / output_scores), or None."""
    fast = block_stops(call.stops, state.lengths(), new_tokens)  # None: a criterion must see every prefix
    streamer = call.streamer
    for i, (b, toks) in enumerate(zip(state.slots, new_tokens)):
        if state.finished[b]:
            continue
        if fast is not None:  # generate()'s own criteria: answered for the whole block from the host's lists
            stop = fast[i]
        else:  # one host tensor per row and cycle; the criteria see its prefixes, as generate() would
            seq = torch.tensor(state.prompt[b] + state.generated[b] + toks, dtype=torch.long)[None]
            stop = first_stop(call.stops, seq, seq.shape[1] - len(toks))
        taken = toks if stop is None else toks[: stop + 1]
        state.generated[b].extend(taken)
        if stop is not None:
            state.finished[b] = state.shrink = True
        if kept is not None:
            for rows, part in zip((state.logits, state.scores), kept):
                if rows is not None:
                    rows[b].extend(part[i, : len(taken)])
        if streamer is not None and b == 0 and taken:
            call.streamer.put(torch.tensor(taken))
