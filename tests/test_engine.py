"""The engine (fixed buffers and shapes, the one storage) gives generate()'s greedy tokens, on 5.17 too, whichever
way its steps run (eager, captured, compiled); its state lives on the decoder of (model, head, device).

The compiled engine runs on the CPU with inductor (no CUDA graphs there): same tokens, each of the cycle's steps
compiled once, and every input they write in place of static address, which is what CUDA graphs need. CUDA graphs
(the default on CUDA) are checked against the eager engine on CUDA only.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import eagle_mm as em
from tests.doubles import ForcedHead
from tests.tiny import prompt, tiny_model

TREE = em.TreeConfig(depth=4, top_k=3, total_tokens=10)
CHAIN = em.TreeConfig.chain(4)


def _forced(model, ids, mask, n_new, rate=0.25, seed=1):
    """A head whose proposals are the target's greedy continuation (per row, by position), wrong at ``rate``."""
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=n_new + 8, do_sample=False)
    rows = [r[m.bool().tolist() + [True] * (r.numel() - m.numel())] for r, m in zip(ref, mask)]
    width = max(r.numel() for r in rows)
    table = torch.stack([torch.cat((r, r.new_zeros(width - r.numel()))) for r in rows])  # (B, T) by position
    wrong = torch.rand(table.shape, generator=torch.Generator().manual_seed(seed)) < rate
    return ForcedHead(em.Eagle3Head.from_target(model), table, wrong), ref


def _run(model, head, ids, mask, n_new, tree, **kw):
    return em.speculative_generate(model, head, ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                                   tree=tree, return_dict_in_generate=True, **kw)


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_static_equals_generate(family, tree):
    model = tiny_model(family)
    ids = prompt(10)
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, 24)
    out = _run(model, head, ids, mask, 24, tree)
    assert out.stats.engine == "fixed"
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.stats.mean_accept_length > 1.5  # the forced head gets accepted: kept paths were exercised


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_static_batch_with_padding(family):
    """Rows that accept different counts leave holes in the static cache; left padding too."""
    model = tiny_model(family)
    ids = prompt(9, batch=3, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    head, ref = _forced(model, ids, mask, 20, rate=0.3)
    out = _run(model, head, ids, mask, 20, TREE)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.sequences.shape[1] == ids.shape[1] + 20


def test_static_reuses_cache_between_calls():
    """A second call of the same shape reuses the decoder's cache and the cycle's buffers (what keeps captured graphs
    valid); ``close()`` frees them, and the next call makes a new decoder."""
    model = tiny_model("llama")
    ids = prompt(8)
    head, ref = _forced(model, ids, torch.ones_like(ids), 12)
    first = _run(model, head, ids, None, 12, TREE)
    dec = em.decoder(model, head)
    cache, pos, buf = dec.storage.cache, dec.storage.pos, dec.storage.full
    second = _run(model, head, ids, None, 12, TREE)
    shorter = _run(model, head, ids[:, 2:], None, 6, TREE)  # fits: reused too
    assert em.decoder(model, head) is dec
    assert dec.storage.cache is cache and dec.storage.pos is pos and dec.storage.full is buf
    assert torch.equal(first.sequences, second.sequences)
    assert torch.equal(first.sequences, ref[:, : first.sequences.shape[1]])
    assert torch.equal(shorter.sequences, model.generate(ids[:, 2:], max_new_tokens=6, do_sample=False))
    dec.close()
    assert dec.storage.cache is None and dec.storage.full is None and em.decoder(model, head) is not dec
    assert torch.equal(_run(model, head, ids, None, 12, TREE).sequences, first.sequences)


def test_a_call_nested_in_a_running_one_is_refused():
    """A stopping criterion that decodes with the same model and head would overwrite the running call's cache: the
    nested call is refused with one clear error (a call with another head has its own decoder and runs)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    model = tiny_model("llama")
    head, other = em.Eagle3Head.from_target(model), em.Eagle3Head.from_target(model)
    seen = []

    class Nested(StoppingCriteria):
        def __init__(self, with_head):
            self.with_head = with_head

        def __call__(self, input_ids, scores, **kwargs):
            if not seen:
                seen.append(em.speculative_generate(model, self.with_head, prompt(5), max_new_tokens=3))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    out = em.speculative_generate(model, head, prompt(6), max_new_tokens=4,
                                  stopping_criteria=StoppingCriteriaList([Nested(other)]))
    assert seen and seen[0].shape == (1, 8)
    assert torch.equal(out, model.generate(prompt(6), max_new_tokens=4, do_sample=False))
    seen.clear()
    with pytest.raises(RuntimeError, match="inside a call that is decoding with them"):
        em.speculative_generate(model, head, prompt(6), max_new_tokens=4,
                                stopping_criteria=StoppingCriteriaList([Nested(head)]))
    assert torch.equal(em.speculative_generate(model, head, prompt(6), max_new_tokens=4),
                       model.generate(prompt(6), max_new_tokens=4, do_sample=False))  # the decoder is usable again


def test_a_dropped_head_or_model_frees_its_decoder_at_once():
    """The decoder lives on its head, weakly keyed by the model, and refers back to neither: dropping either frees
    the cache and buffers at once, without waiting for the garbage collector's cycle search."""
    import gc
    import weakref

    model = tiny_model("llama")
    gc.disable()
    try:
        for drop in ("head", "model"):
            target = model if drop == "head" else tiny_model("llama")
            head = em.Eagle3Head.from_target(target)
            em.speculative_generate(target, head, prompt(6), max_new_tokens=4)
            dec = weakref.ref(em.decoder(target, head))
            cache = weakref.ref(dec().storage.cache)
            if drop == "head":
                del head
            else:
                del target
            assert dec() is None and cache() is None, drop
    finally:
        gc.enable()


def test_default_call_takes_the_engine_on_cpu():
    model = tiny_model("llama")
    ids = prompt(8)
    head, ref = _forced(model, ids, torch.ones_like(ids), 12)
    out = em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert (out.stats.engine, out.stats.mode) == ("fixed", None)  # eager on a CPU: nothing to compile
    assert out.stats.choices and out.stats.choices[0].tree == out.stats.tree  # the chooser's (tests/test_chooser.py)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    for eager in (dict(cache_implementation="dynamic"), dict(compile=False)):  # requests for eager steps
        out = _run(model, head, ids, None, 12, TREE, **eager)
        assert (out.stats.engine, out.stats.mode) == ("fixed", None)
        assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    sampled = em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=True, return_dict_in_generate=True)
    assert sampled.stats.choices and sampled.stats.choices[0].tree == sampled.stats.tree
    assert (sampled.stats.engine, sampled.stats.mode) == ("fixed", None)


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_sampling_repeats_for_one_seed(tree):
    """The draft's and the verify's noise come from the generator in one order, call after call (the second call
    reuses the decoder's buffers and its draft sampler): one seed, the same tokens (the distribution itself is
    checked in tests/test_sampling_e2e.py)."""
    model = tiny_model("llama")
    ids = prompt(8, batch=2, seed=3)
    head = em.Eagle3Head.from_target(model)
    outs = [em.speculative_generate(model, head, ids, max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9,
                                    tree=tree, generator=torch.Generator().manual_seed(7), return_dict_in_generate=True,
                                    cache_implementation=c) for c in (None, "dynamic", None)]
    assert all(torch.equal(o.sequences, outs[0].sequences) for o in outs)
    assert all(o.stats.accept_counts == outs[0].stats.accept_counts for o in outs)


def test_steps_that_cannot_be_captured_run_eagerly_and_say_why(caplog):
    """A target split over devices cannot be captured on one: where CUDA graphs or a compiler were asked for, the
    steps run eagerly, with one logged line naming the devices; the call itself gives generate()'s tokens."""
    from eagle_mm.decode.options import choose_mode

    model = tiny_model("llama")
    cuda = torch.device("cuda")  # a device type only: nothing runs on it
    assert choose_mode(None, None, model, device=cuda) == "graphs"
    model.hf_device_map = {"model": 0, "lm_head": 1}  # what accelerate records for a split model
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.options"):
        assert choose_mode(None, "max-autotune", model, device=cuda) is None
        assert choose_mode(None, True, model, device="cpu") is None
    lines = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(lines) == 2 and all("split over devices ['0', '1']" in line for line in lines)
    ids = prompt(8)
    out = em.speculative_generate(model, em.Eagle3Head.from_target(model), ids, max_new_tokens=8, tree=TREE,
                                  return_dict_in_generate=True)
    assert out.stats.mode is None
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_a_warper_subclass_runs_in_the_engine_as_generate_calls_it():
    """A subclass of a transformers warper may treat rows differently: the engine runs it (and the draft leaves it
    out of its proposal, which any distribution may be) as generate() calls it, row by row."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    class MyTemperature(TemperatureLogitsWarper):
        def __call__(self, input_ids, scores):  # and row b favours token 3 b + 5
            favoured = 3 * torch.arange(scores.shape[0])[:, None] + 5
            return (scores / self.temperature).scatter_add(1, favoured, torch.full_like(favoured, 40.0).float())

    model = tiny_model("llama")
    ids = prompt(8, batch=2)
    head = em.Eagle3Head.from_target(model)
    opts = dict(max_new_tokens=8, do_sample=True, top_k=1, logits_processor=LogitsProcessorList([MyTemperature(0.5)]))
    out = em.speculative_generate(model, head, ids, tree=TREE, generator=torch.Generator().manual_seed(0),
                                  return_dict_in_generate=True, **opts)
    assert torch.equal(out.sequences, model.generate(ids, **opts))


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_implementation="offloaded"), "cache_implementation='offloaded'"),
    (dict(cache_implementation="dynamic", compile=True), "asks for eager steps"),
    (dict(compile="fast"), "compile='fast'"),
    (dict(tree={"depth": 3, "width": 2}), "unknown field"),
    (dict(tree=[3, 2]), "expected a TreeConfig"),
])
def test_bad_options(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises((ValueError, TypeError), match=match):
        em.speculative_generate(model, em.Eagle3Head.from_target(model), prompt(6), max_new_tokens=4, **kwargs)


def test_tree_as_a_dict():
    model = tiny_model("llama")
    out = em.speculative_generate(model, em.Eagle3Head.from_target(model), prompt(6), max_new_tokens=4,
                                  tree={"depth": 3, "top_k": 2, "total_tokens": 4}, return_dict_in_generate=True)
    assert out.stats.tree == em.TreeConfig(depth=3, top_k=2, total_tokens=4)


def test_layer_kinds_of_the_engine():
    from eagle_mm.decode.masks import LayerKind, layer_kinds

    cfg = tiny_model("llama").config
    n = cfg.num_hidden_layers
    cfg.layer_types, cfg.attention_chunk_size = ["chunked_attention"] * n, 8
    assert layer_kinds(cfg, n) == [LayerKind("chunked_attention", chunk=8)] * n  # stored in full, masked by chunk
    cfg.layer_types = ["linear_attention"] * n
    with pytest.raises(ValueError, match="linear_attention"):
        layer_kinds(cfg, n)


def test_what_the_engine_cannot_take_is_one_clear_error():
    """An attention kind tree verification cannot mask: one ValueError naming it, before any cycle."""
    model = tiny_model("llama")
    model.config.layer_types = ["linear_attention"] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="layer 0 has attention type 'linear_attention'"):
        em.speculative_generate(model, em.Eagle3Head.from_target(model), prompt(6), max_new_tokens=4)


def _compiled_steps(model, head) -> list:
    """The engine's compiled steps (``compiled.DiskCompiled``) for this model and head."""
    return list(em.decoder(model, head).runner.compiled.values())


@pytest.mark.slow
def test_compiled_cpu_equals_eager_without_recompiles():
    """torch.compile (inductor, no CUDA graphs on a CPU): same tokens; the verify and the update compile (or load
    from the disk) once each (the steps compile= compiles), whole (no graph break), and neither a later cycle nor a
    second call compiles anything."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(8)
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, 16)
    eager = _run(model, head, ids, mask, 16, TREE, cache_implementation="static", compile=False)
    first = _run(model, head, ids, mask, 16, TREE, compile="default")
    steps = _compiled_steps(model, head)

    def built():
        return sum(f.compiled + f.loaded for f in steps)

    assert first.stats.num_target_forwards >= 4  # later cycles reused the first cycle's compilations
    assert len(steps) == 2 and built() == 2  # a recompile in a later cycle would add one
    assert all(f._plain is None for f in steps)  # compiled ahead of time: whole, saved on disk
    assert first.stats.time_compile > 0
    second = _run(model, head, ids, mask, 16, TREE, compile="default")
    assert second.stats.time_compile == 0  # a second call with the same shapes pays nothing
    for out in (first, second):
        assert torch.equal(out.sequences, eager.sequences)
        assert out.stats.accept_counts == eager.stats.accept_counts
    assert torch.equal(eager.sequences, ref[:, : eager.sequences.shape[1]])
    # A shorter prompt fits the same cache and prefill bucket: nothing recompiles.
    short, short_mask = ids[:, 3:], mask[:, 3:]
    short_eager = _run(model, head, short, short_mask, 16, TREE, cache_implementation="static", compile=False)
    short_comp = _run(model, head, short, short_mask, 16, TREE, compile="default")
    assert torch.equal(short_comp.sequences, short_eager.sequences)
    assert built() == 2


def _recording_wrapper(seen: dict):
    """A stand-in for ``Runner._wrapper`` whose backend records, per graph, which inputs it writes in place and
    which inputs have a static address (parameters, buffers, ``mark_static_address``), as inductor sees them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from eagle_mm.decode.runner import step_mode

    compiled = {}

    def wrapper(runner, step, fn, device):
        if step_mode(step, runner.mode) is None:
            return fn

        def fw(gm, example_inputs):
            meta = torch._guards.TracingContext.get().fw_metadata
            mutated = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
            seen.setdefault(step, []).append((mutated, set(meta.static_input_indices)))
            return make_boxed_func(gm.forward)

        key = (id(runner), step)
        if key not in compiled:
            compiled[key] = torch.compile(fn, backend=aot_autograd(fw_compiler=fw), dynamic=False)
        return compiled[key]

    return wrapper


@pytest.mark.parametrize("do_sample,extra", [(False, {}), (True, {}), (False, dict(min_new_tokens=12, eos_token_id=3))],
                         ids=["greedy", "sampling", "greedy_min_length"])
def test_compiled_graphs_write_only_static_inputs(monkeypatch, do_sample, extra):
    """A CUDA graph writes only into memory it owns or that stays at its address. CPU has no CUDA graphs, so check
    the condition itself on every step the cycle captures: the prefill, the draft (greedy and sampled), the
    verify, the acceptance (sampled, or greedy with processors) and the update (all captured on CUDA; compile=
    compiles some of them: all are traced here)."""
    import eagle_mm.decode.runner as runner

    seen = {}
    monkeypatch.setattr(runner.Runner, "_wrapper", _recording_wrapper(seen))
    monkeypatch.setattr(runner, "_COMPILED_STEPS", ("prefill", "verify", "draft", "update", "accept"))
    model = tiny_model("llama")
    ids = prompt(8)
    head, _ = _forced(model, ids, torch.ones_like(ids), 12)
    kw = dict(max_new_tokens=12, tree=TREE, do_sample=do_sample, top_k=20, **extra)
    outs = [em.speculative_generate(model, head, ids, generator=torch.Generator().manual_seed(3), **kw,
                                    cache_implementation="static", compile=c) for c in (False, "default")]
    assert torch.equal(outs[0], outs[1])  # the same ops, traced: the same tokens, sampled ones included
    # greedy without processors launches its acceptance eagerly (loop.py says why)
    captured = do_sample or bool(extra)
    assert sorted(seen) == ["accept"] * captured + ["draft", "prefill", "update", "verify"]
    for name, graphs in seen.items():
        assert len(graphs) == 1, name  # one graph each, reused every cycle
        mutated, static = graphs[0]
        assert mutated <= static, f"{name} writes inputs {sorted(mutated - static)} of non-static address"
        assert bool(mutated) == (name != "accept"), name  # each step but the acceptance writes in place


def _cuda_forced(n_new, dtype=torch.float32):
    model = tiny_model("llama").cuda().to(dtype)
    ids = prompt(10, batch=1).cuda()
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, n_new)
    head._head.cuda().to(dtype)
    head.reference, head.wrong = head.reference.cuda(), head.wrong.cuda()
    return model, head, ids, mask, ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("compile", [None, True], ids=["graphs", "inductor"])
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_graphs_equal_eager_cuda(tree, compile):
    """The default call on CUDA captures the engine's eager steps (compile=None), or compiles them first: the
    eager engine's tokens, and a second call captures nothing."""
    model, head, ids, mask, ref = _cuda_forced(32)
    eager = _run(model, head, ids, mask, 32, tree, cache_implementation="static", compile=False)
    first = _run(model, head, ids, mask, 32, tree, compile=compile)
    assert first.stats.mode == ("graphs" if compile is None else "reduce-overhead")
    runner = em.decoder(model, head).runner
    captures = runner.captures
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = _run(model, head, ids, mask, 32, tree, compile=compile)
    assert captures > 0 and runner.captures == captures and second.stats.time_compile == 0
    for out in (first, second):
        assert torch.equal(out.sequences, eager.sequences)
        assert out.stats.accept_counts == eager.stats.accept_counts
    assert torch.equal(eager.sequences, ref[:, : eager.sequences.shape[1]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_sampling_cuda():
    """Sampling in the captured engine (the draft's noise drawn outside the graph): the eager engine's tokens for
    one generator seed, at the first call (warm-up and capture) and at the second (replays only)."""
    model = tiny_model("llama").cuda()
    ids = prompt(10, batch=1).cuda()
    head = em.Eagle3Head.from_target(model).cuda()
    outs = [em.speculative_generate(model, head, ids, max_new_tokens=24, do_sample=True, tree=TREE, top_p=0.9,
                                    generator=torch.Generator("cuda").manual_seed(5), cache_implementation=c,
                                    compile=m) for c, m in (("static", False), (None, None), (None, None))]
    assert outs[0].shape == (1, 34)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_drop_finished_rows_cuda():
    """Rows that stop early leave the captured engine's batch (4 rows, then 2, then 1): generate()'s tokens, one
    graph per batch size, and once a call has run at the cache length calls of this shape reach (the cache grows
    with the tokens, and is kept), a later call replays them all without capturing."""
    from tests.test_batch import _batch

    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in _batch())
    cont = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)[:, ids.shape[1]:]
    eos = int(cont[0, 4])
    model.generation_config.eos_token_id = eos
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    stops = {int((r == eos).nonzero()[0]) if (r == eos).any() else 30 for r in ref[:, ids.shape[1]:]}
    assert len(stops) >= 3
    head = em.Eagle3Head.from_target(model).cuda()
    kw = dict(attention_mask=mask, max_new_tokens=30, tree=TREE, return_dict_in_generate=True)
    em.speculative_generate(model, head, ids, **kw)  # grows the cache to what these calls reach
    first = em.speculative_generate(model, head, ids, **kw)
    runner = em.decoder(model, head).runner
    n = runner.captures
    second = em.speculative_generate(model, head, ids, **kw)
    assert first.stats.mode == "graphs" and runner.captures == n and second.stats.time_compile == 0
    assert runner.graphs("verify") >= 2  # a graph per batch size (the prompt bucket is the same)
    for out in (first, second):
        assert torch.equal(out.sequences, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_sampled_batch_cuda():
    """Sampling in the captured engine (the draft, and the acceptance with its noise drawn outside the graph) over a
    batch whose first row stops early (2 rows, then 1): the eager engine's tokens for one seed at every call, and
    once a call has grown the kept cache to what these calls reach, a later call captures nothing."""
    model = tiny_model("llama").cuda()
    ids = prompt(8, batch=2, seed=3).cuda()
    head = em.Eagle3Head.from_target(model).cuda()

    def run(**kw):
        return em.speculative_generate(model, head, ids, max_new_tokens=24, do_sample=True, temperature=0.8,
                                       top_k=20, tree=TREE, generator=torch.Generator("cuda").manual_seed(5),
                                       return_dict_in_generate=True, **kw)

    free = run(cache_implementation="static", compile=False).sequences[:, ids.shape[1]:]
    eos = next(int(t) for t in free[0] if int(t) not in free[1].tolist())  # row 0 stops there, row 1 goes on
    model.generation_config.eos_token_id = eos
    eager = run(cache_implementation="static", compile=False)
    run()  # grows the kept cache to what these calls reach
    first = run()
    runner = em.decoder(model, head).runner
    captures = runner.captures
    second = run()
    assert first.stats.mode == "graphs" and runner.graphs("accept") >= 1
    assert runner.captures == captures
    for out in (first, second):
        assert torch.equal(out.sequences, eager.sequences)
    assert int((eager.sequences[0, ids.shape[1]:] == eos).sum()) >= 1  # row 0 did stop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton verify kernel runs on a CUDA GPU here")
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_triton_verify_bf16_equals_generate_cuda(tree, monkeypatch):
    """Eager and captured steps verify with the Triton kernel on CUDA: token-identical to generate in bf16 with this
    forced head (its proposals are generate's own tokens)."""
    from eagle_mm.kernels.dispatch import ENV_BACKEND

    monkeypatch.setenv(ENV_BACKEND, "triton")
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids = prompt(10, batch=1).cuda()
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, 32)
    head._head.cuda().to(torch.bfloat16)
    head.reference, head.wrong = head.reference.cuda(), head.wrong.cuda()
    for eager in (False, True):
        out = _run(model, head, ids, mask, 32, tree, cache_implementation="dynamic" if eager else None)
        assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
        assert out.stats.mean_accept_length > 1.5


def test_sampled_calls_share_one_graph_sampler():
    """The engine's draft step is keyed on its sampler: calls with the same warper settings get the same object from
    the decoder (so a captured draft replays), other settings another one."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    from eagle_mm.decode.draft import DraftSampler

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    dec = em.decoder(model, head)

    def sampler(t, p):
        procs = LogitsProcessorList([TemperatureLogitsWarper(t), TopPLogitsWarper(p)])
        dec.begin(TREE, None, 1, 8, 16, DraftSampler.from_processors(procs, head, torch.Generator().manual_seed(0)))
        return dec.sampler

    assert sampler(0.8, 0.9) is sampler(0.8, 0.9)
    assert sampler(0.8, 0.9) is not sampler(0.7, 0.9)
    assert sampler(0.8, 0.9).generator is None  # the call's generator stays with the call


def test_compile_modes_compile_the_cycle_steps_only():
    """compile=: the verify and the update are compiled; the draft only in the max-autotune modes; the prefill never
    (captured as it is where the mode captures graphs)."""
    from eagle_mm.decode.runner import step_mode as _step_mode

    steps = ("prefill", "draft", "verify", "update")
    assert [_step_mode(s, "reduce-overhead") for s in steps] == ["graphs", "graphs", "reduce-overhead",
                                                                  "reduce-overhead"]
    assert [_step_mode(s, "default") for s in steps] == [None, None, "default", "default"]
    assert [_step_mode(s, "max-autotune") for s in steps] == ["graphs"] + ["max-autotune"] * 3
    assert [_step_mode(s, "graphs") for s in steps] == ["graphs"] * 4
    assert [_step_mode(s, None) for s in steps] == [None] * 4


def test_warmup_runs_the_shapes_ahead():
    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    seconds = em.warmup(model, head, batch_sizes=(2,), prompt_lengths=(9,), max_new_tokens=8, tree=TREE)
    storage = em.decoder(model, head).storage
    cache = storage.cache
    assert seconds > 0 and storage.pos.shape[0] == 2
    out = em.speculative_generate(model, head, prompt(9, batch=2), max_new_tokens=8, tree=TREE,
                                  return_dict_in_generate=True)
    assert out.stats.time_compile == 0 and storage.cache is cache  # the warmed-up cache, not a new one


def test_warmup_shrinks_a_batch_to_one_row(monkeypatch):
    """warmup's batches also run with rows stopping one after another, so that every smaller batch the engine moves
    to when rows finish (its own graphs on CUDA) is run ahead too, down to one row."""
    from eagle_mm.decode.storage import Storage

    sizes, compact = [], Storage.compact
    monkeypatch.setattr(Storage, "compact", lambda self, keep: (sizes.append(len(keep)), compact(self, keep))[1])
    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    em.warmup(model, head, batch_sizes=(4,), prompt_lengths=(9,), max_new_tokens=16, do_sample=False, tree=CHAIN)
    assert sizes == [3, 2, 1]  # eager (a CPU): exactly the live rows; CUDA graphs round up to 4, 2, 1


def test_a_compile_failure_falls_back_with_a_warning(monkeypatch, caplog):
    """compile=...: a step whose compilation fails runs uncompiled, with one warning per step, same tokens."""
    import eagle_mm.decode.compiled as compiled

    class Failing:
        def __init__(self, fn, **_options):
            pass

        def __call__(self, *args):
            raise torch._dynamo.exc.BackendCompilerFailed(Failing, RuntimeError("no compiler here"), None)

        def aot_compile(self, example_inputs):
            return self(*example_inputs[0])

    monkeypatch.setattr(compiled.torch, "compile", Failing)
    monkeypatch.setattr(compiled, "cache_folder", lambda: Path("/nonexistent/eagle_mm"))  # nothing to load
    model = tiny_model("llama")
    ids = prompt(8)
    head, ref = _forced(model, ids, torch.ones_like(ids), 12)
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        out = _run(model, head, ids, None, 12, TREE, compile="default")
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]]) and out.stats.mode == "default"
    failed = {r.getMessage().split(" failed")[0] for r in caplog.records if "runs uncompiled" in r.getMessage()}
    assert len(failed) == 2  # the verify and the update: the steps compile= compiles


def _engine_bytes(model, head) -> int:
    """Bytes of what the engine keeps for this model and head: the target's KV cache and the head's KV buffers."""
    storage = em.decoder(model, head).storage
    layers = [la for la in storage.cache.layers if la.is_initialized]
    return sum(t.nbytes for la in layers for t in (la.keys, la.values)) + sum(
        t.nbytes for t in (storage.full.head.k, storage.full.head.v))


def test_a_huge_max_new_tokens_that_stops_early_allocates_what_it_uses():
    """max_new_tokens=100000 on a batch of 8 whose rows all stop after one token: the engine's cache grows with the
    tokens committed, so it holds about what generate()'s does (the prompt's bucket and one block of slots, where
    the worst case up front was 400,000 slots a row)."""
    model = tiny_model("llama")
    ids = prompt(200, batch=8, seed=4)
    first = model.generate(ids, max_new_tokens=1, do_sample=False)[:, -1]
    model.generation_config.eos_token_id = sorted(set(first.tolist()))  # every row stops after its first token
    head = em.Eagle3Head.from_target(model)
    ref = model.generate(ids, max_new_tokens=100000, do_sample=False, return_dict_in_generate=True)
    out = em.speculative_generate(model, head, ids, max_new_tokens=100000, tree=TREE)
    assert torch.equal(out, ref.sequences)
    theirs = sum(la.keys.nbytes + la.values.nbytes for la in ref.past_key_values.layers)
    assert _engine_bytes(model, head) < 4 * theirs


def _growing_call(device: str):
    """A tiny model, a batch of 3 rows (one stops early) and a forced head for a 300-token call, on ``device``."""
    from tests.test_batch import _batch

    model = tiny_model("llama").to(device)
    ids, mask = (t.to(device) for t in _batch([5, 9, 3]))
    cont = model.generate(ids, attention_mask=mask, max_new_tokens=300, do_sample=False)[:, ids.shape[1]:]
    eos = int(cont[0, 60])
    model.generation_config.eos_token_id = eos  # row 0 stops after 61 tokens at most, the others when they emit it
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=300, do_sample=False)
    longer = model.generate(ids, attention_mask=mask, max_new_tokens=320, do_sample=False)
    pad = ids.shape[1] - mask.sum(1)
    by_pos = torch.stack([torch.roll(longer[b], -int(pad[b])) for b in range(3)])
    wrong = torch.rand(by_pos.shape, generator=torch.Generator().manual_seed(2)).to(device) < 0.2
    return model, ids, mask, ref, ForcedHead(em.Eagle3Head.from_target(model), by_pos, wrong)


def _spy_growth(monkeypatch) -> list:
    from eagle_mm.decode.storage import Storage

    lengths, grow = [], Storage.grow
    monkeypatch.setattr(Storage, "grow", lambda self, n: (lengths.append(n), grow(self, n))[1])
    return lengths


def test_the_cache_grows_as_tokens_are_committed_and_a_small_call_releases_it(monkeypatch):
    """A long call starts small and grows its cache in steps (doubling) as rows commit tokens, with generate()'s
    tokens in a batch whose rows stop at different times; a later short call does not keep the long call's cache."""
    import weakref

    model, ids, mask, ref, head = _growing_call("cpu")
    lengths = _spy_growth(monkeypatch)
    out = em.speculative_generate(model, head, ids, attention_mask=mask, max_new_tokens=300, tree=CHAIN)
    assert torch.equal(out, ref)
    assert len(lengths) >= 2 and all(b == 2 * a for a, b in zip(lengths, lengths[1:]))  # grown by doubling
    storage = em.decoder(model, head).storage
    big = weakref.ref(storage.cache.layers[0].keys)
    assert big().shape[2] == lengths[-1]
    em.speculative_generate(model, head, ids, attention_mask=mask, max_new_tokens=4, tree=CHAIN)
    assert big() is None and storage.cache.layers[0].max_cache_len < lengths[-1]


def test_release_frees_what_the_engine_keeps():
    """eagle_mm.release(model, head): the decoder's cache, buffers and graphs go (their memory with them); the next
    call allocates again and decodes as before; eagle_mm.release(model): every head used with the model."""
    import weakref

    model = tiny_model("llama")
    ids = prompt(8)
    head, ref = _forced(model, ids, torch.ones_like(ids), 12)
    other = em.Eagle3Head.from_target(model)
    for h in (head, other):
        assert torch.equal(_run(model, h, ids, None, 12, TREE).sequences[:, :8], ids)
    dec = em.decoder(model, head)
    kept = [weakref.ref(dec.storage.cache.layers[0].keys), weakref.ref(dec.storage.full.head.k)]
    em.release(model, head)
    assert all(r() is None for r in kept) and em.decoder(model, head) is not dec
    assert em.decoder(model, other).storage.cache is not None  # another head's decoder is left alone
    assert torch.equal(_run(model, head, ids, None, 12, TREE).sequences, ref[:, : ids.shape[1] + 12])
    em.release(model)  # every head used with the model
    assert all(em.decoder(model, h).storage.cache is None for h in (head, other))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_the_cache_grows_in_the_captured_engine_cuda(monkeypatch):
    """Growing mid-call in the captured engine (new addresses, new graphs, a draft queued ahead moved along):
    generate()'s tokens; a second call starts at the length the first reached, and a third captures nothing."""
    model, ids, mask, ref, head = _growing_call("cuda")
    head._head.cuda()
    lengths = _spy_growth(monkeypatch)
    kw = dict(attention_mask=mask, max_new_tokens=300, tree=CHAIN, return_dict_in_generate=True)
    outs = [em.speculative_generate(model, head, ids, **kw) for _ in range(2)]
    assert outs[0].stats.mode == "graphs" and len(lengths) >= 2
    runner = em.decoder(model, head).runner
    n = runner.captures
    outs.append(em.speculative_generate(model, head, ids, **kw))
    assert runner.captures == n
    for out in outs:
        assert torch.equal(out.sequences, ref)


class _SecondChoiceHead(ForcedHead):
    """A forced head whose first choice is always wrong and whose second is the target's token."""

    def step(self, embeds, hidden, position_ids, mask, past):
        out, forced, kv = super().step(embeds, hidden, position_ids, mask, past)
        right = forced.argmax(-1, keepdim=True)
        forced = forced.scatter(-1, right, -1.0).scatter(-1, (right + 1) % forced.shape[-1], 0.0)
        return out, forced, kv


@pytest.mark.parametrize("second", [False, True], ids=["first", "second"])
def test_first_choice_counts_follow_the_head_s_ranks(second):
    """``stats.first_counts`` (what the chooser's fit tells a head's first choices by) counts accepted paths of
    first choices: all of them from a head whose first choice is the target's token, none from one whose second
    is; a chain's equal its acceptance counts."""
    model = tiny_model("llama")
    ids = prompt(10)
    mask = torch.ones_like(ids)
    forced, ref = _forced(model, ids, mask, 24, rate=0.0)
    head = _SecondChoiceHead(forced._head, forced.reference, forced.wrong) if second else forced
    out = _run(model, head, ids, mask, 24, em.TreeConfig(depth=2, top_k=4, total_tokens=8))
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    st = out.stats
    assert st.accept_counts[1] > 0.5 * st.num_drafts  # the right tokens were drafted and accepted, two deep
    assert st.first_counts == ([0, 0] if second else st.accept_counts)
    if not second:
        chain = _run(model, _forced(model, ids, mask, 24, rate=0.4)[0], ids, mask, 24, em.TreeConfig.chain(3)).stats
        assert 0 < chain.accept_counts[0] < chain.num_drafts and chain.first_counts == chain.accept_counts
