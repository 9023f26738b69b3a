"""cache_implementation="static": the fixed-shape decode path gives generate()'s greedy tokens, on 5.17 too.

The compiled path runs on the CPU with inductor (no CUDA graphs there): same tokens, each of the cycle's three
graphs (draft, verify, update) compiled once, and every input they write in place of static address, which is
what CUDA graphs need. With CUDA graphs it is checked against the eager static path on CUDA only.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

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
    out = _run(model, head, ids, mask, 24, tree, cache_implementation="static", compile=False)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.stats.mean_accept_length > 1.5  # the forced head gets accepted: kept paths were exercised
    dyn = _run(model, head, ids, mask, 24, tree)
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
    out = _run(model, head, ids, mask, 20, TREE, cache_implementation="static")
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.sequences.shape[1] == ids.shape[1] + 20


def test_static_reuses_cache_between_calls():
    """A second call of the same shape reuses the cache and the cycle's buffers (what keeps compiled graphs valid)."""
    from eagle_mm.static import _CACHES
    from eagle_mm.static_cycle import _BUFFERS

    model = tiny_model("llama")
    ids = prompt(8)
    head, ref = _forced(model, ids, torch.ones_like(ids), 12)
    first = _run(model, head, ids, None, 12, TREE, cache_implementation="static")
    cache, pos, buf = _CACHES[model].cache, _CACHES[model].pos, _BUFFERS[head][1]
    second = _run(model, head, ids, None, 12, TREE, cache_implementation="static")
    shorter = _run(model, head, ids[:, 2:], None, 6, TREE, cache_implementation="static")  # fits: reused too
    assert _CACHES[model].cache is cache and _CACHES[model].pos is pos and _BUFFERS[head][1] is buf
    assert torch.equal(first.sequences, second.sequences)
    assert torch.equal(first.sequences, ref[:, : first.sequences.shape[1]])
    assert torch.equal(shorter.sequences, model.generate(ids[:, 2:], max_new_tokens=6, do_sample=False))


def test_static_sampling_runs():
    model = tiny_model("llama")
    ids = prompt(8)
    out = em.speculative_generate(model, em.Eagle3Head.from_target(model), ids, max_new_tokens=10, do_sample=True,
                                  tree=TREE, generator=torch.Generator().manual_seed(0),
                                  cache_implementation="static")
    assert out.shape == (1, 18)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_implementation="offloaded"), "cache_implementation='offloaded'"),
    (dict(compile=True), "needs fixed shapes"),
    (dict(cache_implementation="static", compile="fast"), "compile='fast'"),
])
def test_bad_options(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        em.speculative_generate(model, em.Eagle3Head.from_target(model), prompt(6), max_new_tokens=4, **kwargs)


def test_static_refuses_chunked_layers():
    from eagle_mm.static import static_kinds

    cfg = tiny_model("llama").config
    cfg.layer_types = ["chunked_attention"] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="chunked_attention"):
        static_kinds(cfg, cfg.num_hidden_layers)


@pytest.mark.slow
def test_compiled_cpu_equals_eager_without_recompiles():
    """torch.compile (inductor, no CUDA graphs on a CPU): same tokens; the draft, the verify and the update compile
    once each, with no graph break, and neither a later cycle nor a second call compiles anything."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(8)
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, 16)
    eager = _run(model, head, ids, mask, 16, TREE, cache_implementation="static", compile=False)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    first = _run(model, head, ids, mask, 16, TREE, cache_implementation="static", compile="default")
    assert first.stats.num_target_forwards >= 4  # later cycles replayed the first cycle's graphs
    assert counters["stats"]["unique_graphs"] - graphs == 3  # a recompile in a later cycle would add one
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = _run(model, head, ids, mask, 16, TREE, cache_implementation="static", compile="default")
    for out in (first, second):
        assert torch.equal(out.sequences, eager.sequences)
        assert out.stats.accept_counts == eager.stats.accept_counts
    assert torch.equal(eager.sequences, ref[:, : eager.sequences.shape[1]])
    # A shorter prompt fits the same static cache: nothing recompiles (strides of prompt-length slices included).
    short, short_mask = ids[:, 3:], mask[:, 3:]
    short_eager = _run(model, head, short, short_mask, 16, TREE, cache_implementation="static", compile=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        short_comp = _run(model, head, short, short_mask, 16, TREE, cache_implementation="static", compile="default")
    assert torch.equal(short_comp.sequences, short_eager.sequences)
    assert counters["stats"]["unique_graphs"] - graphs == 3
    assert sum(counters["graph_break"].values()) == breaks


def _recording_compiled(seen: dict):
    """A stand-in for ``static.compiled`` whose backend records, per graph, which inputs it writes in place and
    which inputs have a static address (parameters, buffers, ``mark_static_address``), as inductor sees them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def make(owner, name, fn, mode, *, fullgraph=False, **_graph_options):
        def fw(gm, example_inputs):
            meta = torch._guards.TracingContext.get().fw_metadata
            mutated = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
            seen.setdefault(name, []).append((mutated, set(meta.static_input_indices)))
            return make_boxed_func(gm.forward)

        return torch.compile(fn, backend=aot_autograd(fw_compiler=fw), dynamic=False, fullgraph=fullgraph)

    return make


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_compiled_graphs_write_only_static_inputs(monkeypatch, do_sample):
    """Inductor runs a graph that writes into an input of non-static address without CUDA graphs ("skipping
    cudagraphs due to mutated inputs"). CPU has no CUDA graphs, so check the condition itself on every graph the
    cycle compiles: the draft (greedy; sampling drafts eagerly with the compiled head step), verify and update."""
    import eagle_mm.generate as gen
    import eagle_mm.static as st
    import eagle_mm.static_cycle as sc

    seen = {}
    for module in (gen, st, sc):
        monkeypatch.setattr(module, "compiled", _recording_compiled(seen))
    model = tiny_model("llama")
    ids = prompt(8)
    head, _ = _forced(model, ids, torch.ones_like(ids), 12)
    kw = dict(max_new_tokens=12, tree=TREE, do_sample=do_sample, cache_implementation="static")
    outs = [em.speculative_generate(model, head, ids, generator=torch.Generator().manual_seed(3), **kw,
                                    compile=c) for c in (False, "default")]
    assert torch.equal(outs[0], outs[1])  # the same ops, traced: the same tokens, sampled ones included
    assert sorted(seen) == (["step", "update", "verify"] if do_sample else ["draft", "update", "verify"])
    for name, graphs in seen.items():
        assert len(graphs) == 1, name  # one graph each, reused every cycle
        mutated, static = graphs[0]
        assert mutated <= static, f"{name} writes inputs {sorted(mutated - static)} of non-static address"
        assert bool(mutated) == (name != "step"), name


def _bump(x, buf):
    buf.add_(x)
    return buf * 2


def test_cudagraph_skip_warns(caplog):
    """A graph that inductor runs without CUDA graphs warns once (here: CPU tensors, which have none)."""
    from eagle_mm.static import compiled

    class Owner:
        pass

    owner, buf = Owner(), torch.zeros(3)
    fn = compiled(owner, "bump", _bump, "reduce-overhead", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="eagle_mm.static"):
        for _ in range(3):
            out = fn(torch.ones(3), buf)
    assert torch.equal(buf, torch.full((3,), 3.0)) and torch.equal(out, buf * 2)
    assert len([r for r in caplog.records if "bump of Owner without CUDA graphs" in r.getMessage()]) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled path (CUDA graphs) needs a CUDA GPU")
@pytest.mark.parametrize("own_graphs", [True, False], ids=["own-graphs", "graph-trees"])
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_compiled_equals_eager_cuda(tree, own_graphs, monkeypatch):
    import eagle_mm.static as st

    monkeypatch.setattr(st, "OWN_GRAPHS", own_graphs)
    model = tiny_model("llama").cuda()
    ids = prompt(10, batch=1).cuda()
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, 32)
    head._head.cuda()
    head.reference, head.wrong = head.reference.cuda(), head.wrong.cuda()
    eager = _run(model, head, ids, mask, 32, tree, cache_implementation="static", compile=False)
    skips = counters["inductor"]["cudagraph_skips"]
    comp = [_run(model, head, ids, mask, 32, tree, cache_implementation="static", compile=True)]
    with torch._dynamo.config.patch(error_on_recompile=True):  # the second call replays the first one's graphs
        comp.append(_run(model, head, ids, mask, 32, tree, cache_implementation="static", compile=True))
    assert counters["inductor"]["cudagraph_skips"] == skips  # draft, verify and update all run as CUDA graphs
    for out in comp:
        assert torch.equal(out.sequences, eager.sequences)
        assert out.stats.accept_counts == eager.stats.accept_counts
    assert torch.equal(eager.sequences, ref[:, : eager.sequences.shape[1]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled path (CUDA graphs) needs a CUDA GPU")
def test_compiled_sampling_cuda():
    """Sampling on the compiled path: the draft stays eager, the verify and update replay CUDA graphs. The same
    generator seed gives the eager path's tokens, at the first compiled call (warm-up and capture) and at the
    second (replays only)."""
    model = tiny_model("llama").cuda()
    ids = prompt(10, batch=1).cuda()
    head = em.Eagle3Head.from_target(model).cuda()
    outs = [em.speculative_generate(model, head, ids, max_new_tokens=24, do_sample=True, tree=TREE,
                                    generator=torch.Generator("cuda").manual_seed(5), cache_implementation="static",
                                    compile=c) for c in (False, True, True)]
    assert outs[0].shape == (1, 34)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton verify kernel runs on a CUDA GPU here")
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_triton_verify_bf16_equals_generate_cuda(tree, monkeypatch):
    """The dynamic-cache path verifies with the Triton kernel on CUDA (on an H200: the packed-pair argmax and
    the programmatically launched walk, the defaults for bf16 there): token-identical to generate."""
    from eagle_mm.kernels.dispatch import ENV_BACKEND

    monkeypatch.setenv(ENV_BACKEND, "triton")
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids = prompt(10, batch=1).cuda()
    mask = torch.ones_like(ids)
    head, ref = _forced(model, ids, mask, 32)
    head._head.cuda().to(torch.bfloat16)
    head.reference, head.wrong = head.reference.cuda(), head.wrong.cuda()
    out = _run(model, head, ids, mask, 32, tree)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.stats.mean_accept_length > 1.5
