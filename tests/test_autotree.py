"""tree="auto": the greedy acceptance replay (against speculative_generate), and the chooser it calibrates."""
from __future__ import annotations

import pytest
import torch

import eagle_mm as em
from bench.forced import NoisyHead
from eagle_mm.decode.acceptance import Acceptance
from eagle_mm.decode.autotree import _draft_candidates, calibrate, calibrate_acceptance, choose_tree
from eagle_mm.decode.chooser import TreeChoice
from eagle_mm.decode.draft import draft_tree, head_cache
from eagle_mm.decode.tree import select_tree
from tests.doubles import ForcedHead
from tests.tiny import prompt, tiny_model

N_NEW = 32


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    return prompt(9)


@pytest.fixture(scope="module")
def reference(model, ids):
    return model.generate(ids, max_new_tokens=N_NEW + 24, do_sample=False)[0]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_candidates_rerank_to_draft_tree(model, kind):
    """The replay's one draft per top_k, cut to a depth and reranked, is draft_tree's tree for that config."""
    head = em.EagleHead.from_target(model) if kind == "eagle" else em.Eagle3Head.from_target(model)
    B, L, F = 2, 11, len(head.feature_layers(6)) * 64
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 96, (B, L), generator=g)
    pos = torch.arange(L).expand(B, L).masked_fill(torch.tensor([[True] * 3 + [False] * (L - 3), [False] * L]), -1)
    cache, out, logits = head_cache(head, torch.randn(B, L, F, generator=g), tokens, pos)
    root, root_pos = tokens[:, -1], pos[:, -1] + 1
    for k in (1, 3, 5):
        cands = _draft_candidates(head, cache, out[:, -1], logits[:, -1], root_pos, k, 5)
        for tree in [em.TreeConfig.chain(4)] if k == 1 else [em.TreeConfig(1, k, 2), em.TreeConfig(3, k, 9),
                                                             em.TreeConfig(5, k, k + 4 * k * k)]:
            m = k + (tree.depth - 1) * k * k
            got = select_tree(root, cands.tokens[:, :m], cands.parent[:, :m], cands.depth[:m], cands.score[:, :m],
                              tree.total_tokens)
            want, _ = draft_tree(head, cache, root, out[:, -1], logits[:, -1], root_pos, tree)
            for name in ("tokens", "parent", "depth"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (kind, tree, name)


TREES = [em.TreeConfig.chain(3), em.TreeConfig(depth=4, top_k=3, total_tokens=8), em.TreeConfig()]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_replay_counts_equal_speculative_generate_forced(family):
    """Greedy decoding is deterministic: the replayed acceptance counts are the loop's, exactly."""
    model, ids = tiny_model(family), prompt(7, seed=2)
    ref = model.generate(ids, max_new_tokens=N_NEW + 16, do_sample=False)[0]
    wrong = torch.rand(ref.numel(), generator=torch.Generator().manual_seed(1)) < 0.3
    head = ForcedHead(em.Eagle3Head.from_target(model), ref, wrong)
    replay = calibrate(model, head, ids, top_ks=(1, 3, 8), max_depth=6, max_new_tokens=N_NEW)
    for tree in TREES:
        out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=N_NEW, tree=tree,
                                      return_dict_in_generate=True)
        assert replay.counts(tree) == (out.stats.num_drafts, out.stats.accept_counts), tree
        assert replay.mean_accept_length(tree) == pytest.approx(out.stats.mean_accept_length, abs=1e-12), tree
        assert out.stats.mean_accept_length > 1.5


def test_replay_equals_speculative_generate_noisy_and_batched(model, ids, reference):
    noisy = NoisyHead(em.EagleHead.from_target(model), reference, 2.5)
    replay = calibrate(model, noisy, ids, top_ks=(1, 3, 8), max_depth=6, max_new_tokens=N_NEW)
    for tree in TREES:
        out = em.speculative_generate(model, noisy, input_ids=ids, max_new_tokens=N_NEW, tree=tree,
                                      return_dict_in_generate=True)
        assert replay.mean_accept_length(tree) == pytest.approx(out.stats.mean_accept_length, abs=1e-12), tree
    # A real (random) head over two prompts in one batch: cycles pool over rows as the stats do.
    head, batch = em.EagleHead.from_target(model), prompt(8, batch=2, seed=5)
    replay = calibrate(model, head, batch, top_ks=(8,), max_depth=6, max_new_tokens=N_NEW)
    out = em.speculative_generate(model, head, input_ids=batch, max_new_tokens=N_NEW, tree=em.TreeConfig(),
                                  return_dict_in_generate=True)
    assert replay.mean_accept_length(em.TreeConfig()) == pytest.approx(out.stats.mean_accept_length, abs=1e-9)


def test_calibrated_acceptance_tells_a_strong_head_from_a_weak_one(model, ids, reference):
    fitted = {}
    for strength in (0.5, 4.0):
        est = Acceptance()
        calibrate_acceptance(model, NoisyHead(em.EagleHead.from_target(model), reference, strength), ids, est,
                             max_new_tokens=N_NEW)
        fitted[strength] = est.fit()
        assert est.observed > 0
    assert fitted[4.0][0] > fitted[0.5][0] + 0.3, fitted
    strong = est.expected_lengths([em.TreeConfig.chain(6)])[em.TreeConfig.chain(6)]
    assert strong > 3


def test_tree_auto_calibrates_the_chooser_and_equals_generate(model, ids, reference):
    head = NoisyHead(em.EagleHead.from_target(model), reference, 4.0)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=N_NEW, tree="auto", autotree_inputs=ids,
                                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference[None, : ids.shape[1] + N_NEW])
    choice = out.stats.choices[0]
    assert choice.tree == out.stats.tree and choice.acceptance[0] > 0.5  # the replay, not the prior
    # Through HF's entry point with a left-padded batch: calibrated on the first row, without its padding.
    batch, mask = prompt(7, batch=2, seed=4), torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    got = model.generate(batch, attention_mask=mask, custom_generate=em.custom_generate, tree="auto",
                         head=em.EagleHead.from_target(model), max_new_tokens=6)
    assert torch.equal(got, model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False))
    with pytest.raises(TypeError, match="'auto'"):
        em.speculative_generate(model, head, input_ids=ids, max_new_tokens=4, tree="big")


def test_choose_tree_returns_the_choice(model, ids, reference):
    head = NoisyHead(em.EagleHead.from_target(model), reference, 4.0)
    choice = choose_tree(model, head, [ids[0]], decode=em.speculative_generate, batch_size=2)
    assert isinstance(choice, TreeChoice) and choice.batch == 2 and choice.finalists
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=8, tree=choice.tree,
                                  return_dict_in_generate=True)
    assert out.stats.tree == choice.tree and out.stats.choices == []


def test_errors_name_the_bad_value(model, ids):
    head = em.EagleHead.from_target(model)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 2"):
        calibrate(model, head, ids, max_new_tokens=1)
    with pytest.raises(ValueError, match="non-empty prompt"):
        calibrate(model, head, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="top_k=97 exceeds"):
        calibrate(model, head, ids, top_ks=(97,), max_new_tokens=4)
    replay = calibrate(model, head, ids, top_ks=(1,), max_depth=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="was not calibrated"):
        replay.accept_lengths(em.TreeConfig(2, 3, 4))
