"""Sampling through speculative_generate keeps the target's distribution exactly.

The empirical distribution of the first 3 new tokens over >= 20k sampled rows (one batched call) is
compared with the target's exact sequence distribution, enumerated with the same HF warpers. The
same test with a wrong acceptance rule patched in must fail: see test_wrong_rule_is_detected.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import transformers as tf
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import eagle_mm as em
import eagle_mm.decode.accept as gen_mod

V, STEPS, N = 7, 3, 24000
PROMPT = torch.tensor([[1, 4, 2, 6]])


def _target():
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # distributions far from uniform, still several likely tokens
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _warpers(temperature, top_k, top_p):
    procs = []
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(procs)


def _exact(model, warp) -> dict:
    """P(x1, x2, x3 | prompt) by enumeration, with the target's processed distributions."""
    probs = {(): 1.0}
    for _ in range(STEPS):
        seqs = list(probs)
        ids = torch.cat((PROMPT.expand(len(seqs), -1), torch.tensor(seqs, dtype=torch.long).view(len(seqs), -1)), 1)
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        p = torch.softmax(warp(ids, logits), -1)
        probs = {s + (t,): probs[s] * float(p[i, t]) for i, s in enumerate(seqs) for t in range(V) if p[i, t] > 0}
    return probs


def _chi2_z(counts: dict, exact: dict, n: int) -> float:
    """Wilson-Hilferty z-score of Pearson's chi-square (cells with expected < 5 pooled)."""
    stat, dof, pool_o, pool_e = 0.0, -1, 0, 0.0
    for seq in set(exact) | set(counts):
        e, o = exact.get(seq, 0.0) * n, counts.get(seq, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat, dof = stat + (o - e) ** 2 / e, dof + 1
    if pool_e > 0:
        stat, dof = stat + (pool_o - pool_e) ** 2 / max(pool_e, 1e-9), dof + 1
    k = 2 / (9 * dof)
    return ((stat / dof) ** (1 / 3) - (1 - k)) / math.sqrt(k)


def _sample_counts(model, head, tree, temperature, top_k, top_p, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = em.speculative_generate(model, head, input_ids=PROMPT.expand(N, -1), max_new_tokens=STEPS, do_sample=True,
                                  temperature=temperature, top_k=top_k, top_p=top_p, tree=tree, generator=g)
    counts: dict = {}
    for row in out[:, PROMPT.shape[1]:].tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


SETTINGS = [(1.0, 0, 1.0), (0.7, 4, 0.9)]
TREES = [em.TreeConfig.chain(3), em.TreeConfig(depth=3, top_k=3, total_tokens=7)]


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize("tree", TREES, ids=["chain", "tree"])
def test_sampled_sequences_follow_target_distribution(temperature, top_k, top_p, tree, monkeypatch):
    if not top_k and tree.top_k > 1:
        # The draft proposes from its 3 most likely tokens only (DraftSampler.width), where the target spreads over
        # all 7: the output must still follow the target (the verifier gets the truncated q).
        import eagle_mm.decode.draft as draft_mod

        monkeypatch.setattr(draft_mod, "DRAFT_WIDTH", 3)
    model = _target()
    head = em.Eagle3Head.from_target(model, aux_layers=(0, 2, 4))
    exact = _exact(model, _warpers(temperature, top_k, top_p))
    assert abs(sum(exact.values()) - 1) < 1e-4
    counts = _sample_counts(model, head, tree, temperature, top_k, top_p)
    z = _chi2_z(counts, exact, N)
    assert z < 4.5, f"chi-square z={z:.2f}: sampled sequences do not follow the target"


def _wrong_rule(tree, p, q, generator=None):
    """Accept a node whenever it is the target's most likely token (ignores p's shape): a classic mistake."""
    target_next = p.argmax(-1)
    from eagle_mm.kernels.reference import greedy_accept

    accept_len, best = greedy_accept(tree.tokens, tree.parent, tree.depth, target_next, int(tree.depth.max()))
    bonus = torch.multinomial(p.gather(1, best[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1), 1,
                              generator=generator).squeeze(1)
    return accept_len, best, bonus


@pytest.mark.slow
def test_wrong_rule_is_detected(monkeypatch):
    """The distribution test above must be able to fail: with a wrong acceptance rule it does."""
    model = _target()
    head = em.Eagle3Head.from_target(model, aux_layers=(0, 2, 4))
    temperature, top_k, top_p = SETTINGS[0]
    exact = _exact(model, _warpers(temperature, top_k, top_p))
    def wrong(tree, scores, q, generator=None, noise=None):  # draws its own noise (the torch RNG in the engine)
        return _wrong_rule(tree, torch.softmax(scores, -1), q, generator)

    monkeypatch.setattr(gen_mod, "tree_rejection_sample_scores", wrong)
    counts = _sample_counts(model, head, TREES[1], temperature, top_k, top_p)
    assert _chi2_z(counts, exact, N) > 10


def test_seeded_sampling_is_reproducible():
    model = _target()
    head = em.Eagle3Head.from_target(model, aux_layers=(0, 2, 4))
    ids = PROMPT.expand(3, -1)
    runs = [em.speculative_generate(model, head, input_ids=ids, max_new_tokens=12, do_sample=True, top_k=5, tree=TREES[1],
                                    generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(3)
    a = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=12, do_sample=True, tree=TREES[1])
    torch.manual_seed(3)
    b = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=12, do_sample=True, tree=TREES[1])
    assert torch.equal(a, b)


def test_enumeration_sanity():
    """The oracle itself: exact probabilities sum to one and match a direct 1-step softmax."""
    model = _target()
    exact = _exact(model, _warpers(1.0, 0, 1.0))
    first = {s[0]: 0.0 for s in exact}
    for s, pr in exact.items():
        first[s[0]] += pr
    with torch.no_grad():
        p = torch.softmax(model(PROMPT).logits[0, -1], -1)
    for t, pr in first.items():
        assert pr == pytest.approx(float(p[t]), abs=1e-5)
    assert len(list(itertools.islice(exact, 3))) == 3
