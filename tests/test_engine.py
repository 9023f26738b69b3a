"""The engine (the default; fixed buffers and shapes) gives generate()'s greedy tokens, on 5.17 too, and the
fallback (cache_implementation="dynamic") the same tokens and acceptance.

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
    dyn = _run(model, head, ids, mask, 24, tree, cache_implementation="dynamic")
    assert torch.equal(dyn.sequences, out.sequences)
    assert out.stats.accept_counts == dyn.stats.accept_counts  # same trees, same acceptance


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
    for storage in ("static", "dynamic"):
        out = _run(model, head, ids, mask, 20, TREE, cache_implementation=storage)
        assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
        assert out.sequences.shape[1] == ids.shape[1] + 20


def test_static_reuses_cache_between_calls():
    """A second call of the same shape reuses the cache and the cycle's buffers (what keeps captured graphs valid)."""
    from eagle_mm.decode.fixed import _BUFFERS, _CACHES

    model = tiny_model("llama")
    ids = prompt(8)
    head, ref = _forced(model, ids, torch.ones_like(ids), 12)
    first = _run(model, head, ids, None, 12, TREE)
    cache, pos, buf = _CACHES[model].cache, _CACHES[model].pos, _BUFFERS[head][1]
    second = _run(model, head, ids, None, 12, TREE)
    shorter = _run(model, head, ids[:, 2:], None, 6, TREE)  # fits: reused too
    assert _CACHES[model].cache is cache and _CACHES[model].pos is pos and _BUFFERS[head][1] is buf
    assert torch.equal(first.sequences, second.sequences)
    assert torch.equal(first.sequences, ref[:, : first.sequences.shape[1]])
    assert torch.equal(shorter.sequences, model.generate(ids[:, 2:], max_new_tokens=6, do_sample=False))


def test_default_call_takes_the_engine_on_cpu():
    model = tiny_model("llama")
    ids = prompt(8)
    head, ref = _forced(model, ids, torch.ones_like(ids), 12)
    out = em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert (out.stats.engine, out.stats.mode) == ("fixed", None)  # eager on a CPU: nothing to compile
    assert out.stats.choices and out.stats.choices[0].tree == out.stats.tree  # the chooser's (tests/test_chooser.py)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    fallback = _run(model, head, ids, None, 12, TREE, cache_implementation="dynamic")
    assert fallback.stats.engine == "dynamic"
    sampled = em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=True, return_dict_in_generate=True)
    assert sampled.stats.choices and sampled.stats.choices[0].tree == sampled.stats.tree
    assert (sampled.stats.engine, sampled.stats.mode) == ("fixed", None)


def test_gpu_default_trees_draft_shallower_when_sampling():
    """On a GPU the sampled default trees are shallower (and no larger) than the greedy ones up to batch 8 (later
    levels are rarely accepted when sampling, and each costs a head forward); beyond, both take the narrow tree."""
    from eagle_mm.decode.options import default_tree

    cuda = torch.device("cuda")  # a device type only: nothing runs on it
    for batch in (1, 2, 4, 8):
        greedy, sampled = default_tree(cuda, batch), default_tree(cuda, batch, sampled=True)
        assert sampled.depth < greedy.depth and sampled.total_tokens <= greedy.total_tokens, batch
    assert default_tree(cuda, 1, sampled=True) == em.TreeConfig(depth=4, top_k=6, total_tokens=24)
    assert default_tree(cuda, 16, sampled=True) == default_tree(cuda, 16)


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_sampling_engine_equals_fallback(tree):
    """Both storages draw the draft's and the verify's noise in the same order from the generator: one seed, the
    same tokens (the distribution itself is checked in tests/test_sampling_e2e.py)."""
    model = tiny_model("llama")
    ids = prompt(8, batch=2, seed=3)
    head = em.Eagle3Head.from_target(model)
    outs = [em.speculative_generate(model, head, ids, max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9,
                                    tree=tree, generator=torch.Generator().manual_seed(7), return_dict_in_generate=True,
                                    cache_implementation=c) for c in (None, "dynamic")]
    assert outs[0].stats.engine == "fixed" and outs[1].stats.engine == "dynamic"
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].stats.accept_counts == outs[1].stats.accept_counts


def test_fallback_names_its_reason(caplog):
    """A warper subclass would run inside the engine's draft step: the call falls back, with one logged line."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    class MyTemperature(TemperatureLogitsWarper):
        pass

    model = tiny_model("llama")
    ids = prompt(8)
    head = em.Eagle3Head.from_target(model)
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.options"):
        out = em.speculative_generate(model, head, ids, max_new_tokens=8, do_sample=True, tree=TREE,
                                      logits_processor=LogitsProcessorList([MyTemperature(0.5)]),
                                      generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)
    assert out.stats.engine == "dynamic"
    lines = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(lines) == 1 and "MyTemperature" in lines[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_implementation="offloaded"), "cache_implementation='offloaded'"),
    (dict(cache_implementation="dynamic", compile=True), "needs the engine's fixed shapes"),
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


def _compiled_steps(model, head) -> list:
    """The engine's compiled steps (``compiled.DiskCompiled``) for this model and head."""
    from eagle_mm.decode.compiled import DiskCompiled
    from eagle_mm.decode.graphs import _WRAPPED

    steps = [getattr(f, "inner", f) for owner in (model, head) for f in _WRAPPED.get(owner, {}).values()]
    return [f for f in steps if isinstance(f, DiskCompiled)]


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


def _recording_wrapped(seen: dict):
    """A stand-in for ``graphs.wrapped`` whose backend records, per graph, which inputs it writes in place and
    which inputs have a static address (parameters, buffers, ``mark_static_address``), as inductor sees them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def make(owner, name, fn, mode, **_options):
        if mode is None:
            return fn

        def fw(gm, example_inputs):
            meta = torch._guards.TracingContext.get().fw_metadata
            mutated = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
            seen.setdefault(name, []).append((mutated, set(meta.static_input_indices)))
            return make_boxed_func(gm.forward)

        return torch.compile(fn, backend=aot_autograd(fw_compiler=fw), dynamic=False)

    return make


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_compiled_graphs_write_only_static_inputs(monkeypatch, do_sample):
    """A CUDA graph writes only into memory it owns or that stays at its address. CPU has no CUDA graphs, so check
    the condition itself on every step the cycle captures: the prefill, the draft (greedy and sampled), the
    verify, the sampled acceptance and the update (all captured on CUDA; compile= compiles some of them: all are
    traced here)."""
    import eagle_mm.decode.fixed as fixed

    seen = {}
    monkeypatch.setattr(fixed, "wrapped", _recording_wrapped(seen))
    monkeypatch.setattr(fixed, "_COMPILED_STEPS", ("prefill", "verify", "draft", "update", "accept"))
    model = tiny_model("llama")
    ids = prompt(8)
    head, _ = _forced(model, ids, torch.ones_like(ids), 12)
    kw = dict(max_new_tokens=12, tree=TREE, do_sample=do_sample, top_k=20)
    outs = [em.speculative_generate(model, head, ids, generator=torch.Generator().manual_seed(3), **kw,
                                    cache_implementation="static", compile=c) for c in (False, "default")]
    assert torch.equal(outs[0], outs[1])  # the same ops, traced: the same tokens, sampled ones included
    assert sorted(seen) == ["accept"] * do_sample + ["draft", "prefill", "update", "verify"]  # sampled: accept too
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
    from eagle_mm.decode.graphs import _WRAPPED

    model, head, ids, mask, ref = _cuda_forced(32)
    eager = _run(model, head, ids, mask, 32, tree, cache_implementation="static", compile=False)
    first = _run(model, head, ids, mask, 32, tree, compile=compile)
    assert first.stats.mode == ("graphs" if compile is None else "reduce-overhead")
    captures = sum(f.captures for table in (_WRAPPED[model], _WRAPPED[head])
                   for f in table.values() if hasattr(f, "captures"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = _run(model, head, ids, mask, 32, tree, compile=compile)
    after = sum(f.captures for table in (_WRAPPED[model], _WRAPPED[head])
                for f in table.values() if hasattr(f, "captures"))
    assert after == captures and second.stats.time_compile == 0
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
    graph per batch size, and a second call replays them all without capturing."""
    from eagle_mm.decode.graphs import _WRAPPED
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

    def captures():
        return sum(f.captures for table in (_WRAPPED[model], _WRAPPED[head]) for f in table.values()
                   if hasattr(f, "captures"))

    kw = dict(attention_mask=mask, max_new_tokens=30, tree=TREE, return_dict_in_generate=True)
    first = em.speculative_generate(model, head, ids, **kw)
    n = captures()
    second = em.speculative_generate(model, head, ids, **kw)
    assert first.stats.mode == "graphs" and captures() == n and second.stats.time_compile == 0
    verify = _WRAPPED[model][("verify", "graphs")]
    assert len(verify._graphs) >= 2  # a graph per batch size (the prompt bucket is the same)
    for out in (first, second):
        assert torch.equal(out.sequences, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_sampled_batch_cuda():
    """Sampling in the captured engine (the draft, and the acceptance with its noise drawn outside the graph) over a
    batch whose first row stops early (2 rows, then 1): the eager engine's tokens for one seed, at the first call and
    at the second, which captures nothing."""
    from eagle_mm.decode.graphs import _WRAPPED

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
    first = run()
    captures = sum(f.captures for f in _WRAPPED[head].values() if hasattr(f, "captures"))
    second = run()
    assert first.stats.mode == "graphs" and ("accept", "graphs") in _WRAPPED[head]
    assert sum(f.captures for f in _WRAPPED[head].values() if hasattr(f, "captures")) == captures
    for out in (first, second):
        assert torch.equal(out.sequences, eager.sequences)
    assert int((eager.sequences[0, ids.shape[1]:] == eos).sum()) >= 1  # row 0 did stop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton verify kernel runs on a CUDA GPU here")
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_triton_verify_bf16_equals_generate_cuda(tree, monkeypatch):
    """Both storages verify with the Triton kernel on CUDA: token-identical to generate in bf16 with this forced
    head (its proposals are generate's own tokens)."""
    from eagle_mm.kernels.dispatch import ENV_BACKEND

    monkeypatch.setenv(ENV_BACKEND, "triton")
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids = prompt(10, batch=1).cuda()
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, 32)
    head._head.cuda().to(torch.bfloat16)
    head.reference, head.wrong = head.reference.cuda(), head.wrong.cuda()
    for storage in ("static", "dynamic"):
        out = _run(model, head, ids, mask, 32, tree, cache_implementation=storage)
        assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
        assert out.stats.mean_accept_length > 1.5


def test_sampled_calls_share_one_graph_sampler():
    """The engine's draft step is keyed on its sampler: calls with the same warper settings get the same object
    (so a captured draft replays), other settings another one."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    from eagle_mm.decode.draft import DraftSampler

    head = em.Eagle3Head.from_target(tiny_model("llama"))

    def sampler(t, p):
        procs = LogitsProcessorList([TemperatureLogitsWarper(t), TopPLogitsWarper(p)])
        return DraftSampler.from_processors(procs, head, torch.Generator().manual_seed(0)).for_graphs()

    assert sampler(0.8, 0.9) is sampler(0.8, 0.9)
    assert sampler(0.8, 0.9) is not sampler(0.7, 0.9)
    assert sampler(0.8, 0.9).generator is None  # the call's generator stays with the call


def test_compile_modes_compile_the_cycle_steps_only():
    """compile=: the verify and the update are compiled; the draft only in the max-autotune modes; the prefill never
    (captured as it is where the mode captures graphs)."""
    from eagle_mm.decode.fixed import _step_mode

    steps = ("prefill", "draft", "verify", "update")
    assert [_step_mode(s, "reduce-overhead") for s in steps] == ["graphs", "graphs", "reduce-overhead",
                                                                  "reduce-overhead"]
    assert [_step_mode(s, "default") for s in steps] == [None, None, "default", "default"]
    assert [_step_mode(s, "max-autotune") for s in steps] == ["graphs"] + ["max-autotune"] * 3
    assert [_step_mode(s, "graphs") for s in steps] == ["graphs"] * 4
    assert [_step_mode(s, None) for s in steps] == [None] * 4


def test_warmup_runs_the_shapes_ahead():
    from eagle_mm.decode.fixed import _CACHES

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    seconds = em.warmup(model, head, batch_sizes=(2,), prompt_lengths=(9,), max_new_tokens=8, tree=TREE)
    assert seconds > 0 and _CACHES[model].batch == 2
    out = em.speculative_generate(model, head, prompt(9, batch=2), max_new_tokens=8, tree=TREE,
                                  return_dict_in_generate=True)
    assert out.stats.time_compile == 0 and _CACHES[model].batch == 2


def test_warmup_shrinks_a_batch_to_one_row(monkeypatch):
    """warmup's batches also run with rows stopping one after another, so that every smaller batch the engine moves
    to when rows finish (its own graphs on CUDA) is run ahead too, down to one row."""
    from eagle_mm.decode.fixed import FixedStorage

    sizes, compact = [], FixedStorage.compact
    monkeypatch.setattr(FixedStorage, "compact", lambda self, keep: (sizes.append(len(keep)), compact(self, keep))[1])
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
