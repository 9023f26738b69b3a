"""Greedy speculative output must equal model.generate(do_sample=False), token for token."""
from __future__ import annotations

import pytest
import torch

import eagle_mm as em
from tests.doubles import ForcedHead
from tests.tiny import FAMILIES, prompt, tiny_model

TREES = [em.TreeConfig(), em.TreeConfig.chain(4), em.TreeConfig(depth=1, top_k=3, total_tokens=3),
         em.TreeConfig(depth=3, top_k=2, total_tokens=5)]


def _head(kind, model):
    return em.EagleHead.from_target(model) if kind == "eagle" else em.Eagle3Head.from_target(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_equals_generate_random_head(family, kind):
    model = tiny_model(family)
    head = _head(kind, model)
    for length, tree in [(5, TREES[0]), (13, TREES[1]), (1, TREES[2]), (24, TREES[3])]:
        ids = prompt(length, seed=length)
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)
        out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=12, tree=tree)
        assert torch.equal(out, ref), (family, kind, length, tree)


def _forced(model, kind, ids, n_new, error_rate, seed=0):
    ref = model.generate(ids, max_new_tokens=n_new + 16, do_sample=False)[0]
    g = torch.Generator().manual_seed(seed)
    wrong = torch.rand(ref.numel(), generator=g) < error_rate
    return ForcedHead(_head(kind, model), ref, wrong)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_multi_token_acceptance_is_lossless(family, kind):
    """A draft that mostly knows the answer: long accepted paths through every cache kind."""
    model = tiny_model(family)
    ids = prompt(9)
    n_new = 24
    ref = model.generate(ids, max_new_tokens=n_new, do_sample=False)
    for tree in (em.TreeConfig.chain(5), em.TreeConfig(depth=5, top_k=3, total_tokens=12)):
        head = _forced(model, kind, ids, n_new, error_rate=0.15)
        out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=n_new, tree=tree,
                                      return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (family, kind, tree)
        assert out.stats.mean_accept_length > 2.0 and out.stats.mode is None  # eager steps on a CPU


@pytest.mark.compat
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_acceptance_lengths_span_full_range(kind):
    model = tiny_model("llama")
    ids = prompt(6)
    depth, n_new = 4, 120
    head = _forced(model, kind, ids, n_new, error_rate=0.25, seed=3)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=n_new,
                                  tree=em.TreeConfig.chain(depth), return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=n_new, do_sample=False))
    st = out.stats
    at_least = [st.num_drafts] + st.accept_counts + [0]
    exact = [at_least[i] - at_least[i + 1] for i in range(depth + 1)]  # drafts with accept length i
    seen = {i + 1 for i, n in enumerate(exact) if n}  # tokens per forward, bonus included
    assert seen == set(range(1, depth + 2)), exact


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_max_new_tokens_reached_exactly_inside_accepted_path(family):
    model = tiny_model(family)
    ids = prompt(8)
    for n_new in (1, 2, 7, 11):
        head = _forced(model, "eagle3", ids, n_new, error_rate=0.0)
        ref = model.generate(ids, max_new_tokens=n_new, do_sample=False)
        out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=n_new, tree=em.TreeConfig.chain(6))
        assert out.shape[1] == ids.shape[1] + n_new
        assert torch.equal(out, ref)


@pytest.mark.compat
def test_eos_inside_accepted_path_stops_like_generate():
    model = tiny_model("llama")
    ids = prompt(8)
    cont = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:]
    # A token whose first appearance is mid-way through the continuation.
    first = next(i for i in range(6, 30) if int(cont[i]) not in cont[:i].tolist())
    eos = int(cont[first])
    model.generation_config.eos_token_id = eos
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    assert ref.shape[1] == ids.shape[1] + first + 1
    head = _forced(model, "eagle", ids, 30, error_rate=0.0)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=30, tree=em.TreeConfig.chain(6),
                                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accept_length > 3  # the eos arrived inside a long accepted path
    # eos given as a list, as generate() accepts it
    out2 = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=30, eos_token_id=[eos, 1],
                                   tree=em.TreeConfig.chain(6))
    assert torch.equal(out2, model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=[eos, 1]))


def test_eager_attention_matches_too():
    model = tiny_model("gemma2", attn="eager")
    ids = prompt(11)
    head = _forced(model, "eagle3", ids, 25, error_rate=0.2)
    ref = model.generate(ids, max_new_tokens=25, do_sample=False)
    assert torch.equal(em.speculative_generate(model, head, input_ids=ids, max_new_tokens=25), ref)
