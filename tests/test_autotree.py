"""tree="auto": the cost model's shape, the greedy acceptance replay (against speculative_generate), the choice."""
from __future__ import annotations

import pytest
import torch

import eagle_mm as em
from eagle_mm.decode.autotree import (AutoTreeResult, DeviceCosts, _draft_candidates, calibrate, choose_tree, default_grid,
                               measure_draft_cost, measure_verify_cost, rank_trees)
from eagle_mm.decode.draft import draft_tree, head_cache
from eagle_mm.decode.tree import select_tree
from tests.doubles import ForcedHead
from tests.tiny import prompt, tiny_model

N_NEW = 32


class NoisyHead:
    """Wraps a head; the entry at position t scores every token with fixed noise (seeded per position) and
    adds ``strength`` to ``reference[t + 2]``. The right token then ranks first, second, ... with a
    probability set by ``strength``, so wider trees catch what the top choice misses."""

    def __init__(self, head, reference: torch.Tensor, strength: float, seed: int = 0):
        self._head, self.reference, self.strength = head, reference, strength
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(reference.numel(), head.config.vocab_size, generator=g).to(reference.device)

    def __getattr__(self, name):
        return getattr(self._head, name)

    def parameters(self):
        return self._head.parameters()

    def step(self, embeds, hidden, position_ids, mask, past):
        out, _, kv = self._head.step(embeds, hidden, position_ids, mask, past)
        nxt = (position_ids + 2).clamp(max=self.reference.numel() - 1)  # (B, Q)
        logits = self.noise[nxt].clone()  # (B, Q, V)
        logits.scatter_add_(-1, self.reference[nxt][..., None], logits.new_full((*nxt.shape, 1), self.strength))
        return out, logits, kv


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    return prompt(9)


@pytest.fixture(scope="module")
def reference(model, ids):
    return model.generate(ids, max_new_tokens=N_NEW + 24, do_sample=False)[0]


@pytest.fixture(scope="module")
def replays(model, ids, reference):
    """Replays of a weak and a strong NoisyHead over the default grid's top_ks and depths."""
    out = {}
    for strength in (1.0, 2.5, 4.0):
        head = NoisyHead(em.EagleHead.from_target(model), reference, strength)
        out[strength] = calibrate(model, head, ids, max_new_tokens=N_NEW)
    return out


KS = (1, 2, 4, 6, 8, 10)


def _gpu_like(unit=1e-3):
    """Verify cost flat up to 64 nodes; cheap draft levels."""
    return DeviceCosts(verify={0: 10 * unit, 64: 10.5 * unit}, draft={k: (0.0, 0.2 * unit) for k in KS})


def _cpu_like(unit=1e-3):
    """Every node costs as much as the root: verify(N) = (N + 1) units."""
    return DeviceCosts(verify={0: unit, 64: 65 * unit}, draft={k: (0.0, 0.2 * unit) for k in KS})


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
def test_replay_equals_speculative_generate_forced(family):
    """Greedy decoding is deterministic: the replayed E[L] is the loop's mean accept length, exactly."""
    model, ids = tiny_model(family), prompt(7, seed=2)
    ref = model.generate(ids, max_new_tokens=N_NEW + 16, do_sample=False)[0]
    wrong = torch.rand(ref.numel(), generator=torch.Generator().manual_seed(1)) < 0.3
    head = ForcedHead(em.Eagle3Head.from_target(model), ref, wrong)
    replay = calibrate(model, head, ids, top_ks=(1, 3, 8), max_depth=6, max_new_tokens=N_NEW)
    for tree in TREES:
        out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=N_NEW, tree=tree,
                                      return_dict_in_generate=True)
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


def test_flat_cost_picks_a_large_tree_steep_cost_a_chain(replays):
    replay = replays[2.5]
    flat = rank_trees(replay, _gpu_like(), default_grid())
    steep = rank_trees(replay, _cpu_like(), default_grid())
    assert flat.tree.total_tokens >= 16 and flat.tree.top_k > 1, flat.table()
    assert steep.tree.total_tokens <= 2, steep.table()
    # The choice is the best of its own table, and beats the default tree's prediction on that device.
    for result in (flat, steep):
        assert isinstance(result.tree, em.TreeConfig) and result.tree in default_grid()
        assert result.chosen.tokens_per_second == max(e.tokens_per_second for e in result.candidates)
        assert result.predicted_tokens_per_second >= result.default.tokens_per_second
    assert steep.predicted_tokens_per_second > 1.5 * steep.default.tokens_per_second


def test_accurate_head_drafts_deeper(replays):
    costs = DeviceCosts(verify={0: 5e-3, 64: 8e-3}, draft={k: (1e-4, 1e-3) for k in KS})
    weak, strong = (rank_trees(replays[s], costs, default_grid()) for s in (1.0, 4.0))
    assert strong.tree.depth > weak.tree.depth, (weak.table(), strong.table())
    assert strong.chosen.accept_length > weak.chosen.accept_length + 1


def test_device_costs_interpolate_monotone():
    costs = DeviceCosts(verify={0: 1.0, 8: 2.0, 16: 1.5, 32: 4.0}, draft={2: (0.5, 0.25)}, fixed=0.1)
    # Read through the isotonic fit: 8 and 16 pool to 1.75.
    assert costs.verify_seconds(4) == pytest.approx(1.375)
    assert costs.verify_seconds(16) == pytest.approx(1.75)
    assert costs.verify_seconds(24) == pytest.approx(2.875)
    assert costs.verify_seconds(48) == pytest.approx(6.25)  # extended linearly
    assert costs.cycle_seconds(em.TreeConfig(3, 2, 8)) == pytest.approx(1.75 + 0.5 + 2 * 0.25 + 0.1)
    with pytest.raises(ValueError, match="top_k=4"):
        costs.cycle_seconds(em.TreeConfig(3, 4, 8))


def test_measured_costs_have_the_asked_structure(model):
    """Timings are not asserted (shared CPUs make them noisy), only what was measured."""
    verify = measure_verify_cost(model, (0, 1, 8, 32), prefix_len=16, repeats=1, warmup=0)
    assert sorted(verify) == [0, 1, 8, 32] and all(t > 0 for t in verify.values())
    head = em.Eagle3Head.from_target(model)
    draft = measure_draft_cost(head, (1, 4), depth=3, prefix_len=16, repeats=1, warmup=0)
    assert sorted(draft) == [1, 4] and all(first > 0 and level >= 0 for first, level in draft.values())
    window = measure_verify_cost(tiny_model("mistral"), (16,), prefix_len=12, repeats=1, warmup=0)  # tree > window
    assert list(window) == [16]


def test_choose_tree_end_to_end(model, ids, reference):
    head = NoisyHead(em.EagleHead.from_target(model), reference, 4.0)
    grid = [em.TreeConfig.chain(2), em.TreeConfig.chain(5), em.TreeConfig(4, 4, 16), em.TreeConfig(2, 2, 4)]
    result = choose_tree(model, head, ids, grid=grid, max_new_tokens=16, repeats=1, decode=em.speculative_generate)
    default = em.TreeConfig.chain(3)  # what the default call drafts on a CPU
    assert isinstance(result, AutoTreeResult) and result.tree in grid + [default]
    assert len(result.candidates) == len(grid) and default in result.measured and result.tree in result.measured
    assert result.default.tree == default and set(result.costs.draft) == {1, 2, 4}
    assert 0 in result.costs.verify and 64 in result.costs.verify and result.costs.fixed >= 0
    assert "(default)" in result.table() and result.as_dict()["chosen"]["depth"] == result.tree.depth
    fixed = choose_tree(model, head, [ids[0]], grid=grid, max_new_tokens=16, device_costs=_cpu_like())
    assert fixed.tree == em.TreeConfig.chain(2)


def test_runoff_keeps_the_default_unless_a_finalist_is_clearly_faster(model, ids, replays, monkeypatch):
    """The runoff times the finalists with the real loop: a clearly faster finalist wins; a near-tie goes to the
    default call's tree (tree="auto" must never be slower than it). The clock is a stand-in that each decode moves
    on by its tree's cost: a near-tie within 2% is below a loaded machine's sleep jitter."""
    from types import SimpleNamespace

    import eagle_mm.decode.autotree_costs as costs
    from eagle_mm.decode.autotree import runoff

    clock = [0.0]
    monkeypatch.setattr(costs, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    default, fast, slow = em.TreeConfig.chain(3), em.TreeConfig.chain(5), em.TreeConfig(4, 4, 16)
    result = rank_trees(replays[4.0], _cpu_like(), [fast, slow], default=default)
    for delay, winner in (({default: 0.03, fast: 0.01, slow: 0.05}, fast),
                          ({default: 0.02, fast: 0.0199, slow: 0.05}, default)):
        calls = []

        def decode(model, head, *, tree, **kw):
            calls.append(tree)
            clock[0] += delay[tree]

        got = runoff(result, model, None, ids, decode, default, max_new_tokens=4, repeats=3)
        assert got.tree == winner and set(got.measured) == {default, fast, slow}
        assert calls.count(default) == 4  # one untimed round, then three timed ones
        assert got.candidates is result.candidates  # the predictions are kept


def test_errors_name_the_bad_value(model, ids, replays):
    head = em.EagleHead.from_target(model)
    with pytest.raises(ValueError, match="top_k <= 96"):
        choose_tree(model, head, ids, grid=[em.TreeConfig(2, 97, 97)], device_costs=_cpu_like())
    with pytest.raises(ValueError, match="max_new_tokens must be >= 2"):
        calibrate(model, head, ids, max_new_tokens=1)
    with pytest.raises(ValueError, match="non-empty prompt"):
        calibrate(model, head, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="was not calibrated"):
        replays[1.0].accept_lengths(em.TreeConfig(2, 3, 4))
    with pytest.raises(ValueError, match="sizes"):
        measure_verify_cost(model, (-1,))


def test_speculative_generate_tree_auto(model, ids, reference):
    head = NoisyHead(em.EagleHead.from_target(model), reference, 4.0)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=N_NEW, tree="auto", autotree_inputs=ids,
                                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference[None, : ids.shape[1] + N_NEW])
    assert out.stats.tree == out.stats.autotree.tree and out.stats.tree.depth > 1
    assert out.stats.as_dict()["autotree"]["chosen"]["depth"] == out.stats.tree.depth
    # Through HF's entry point with a left-padded batch: calibrated on the first row, without its padding.
    batch, mask = prompt(7, batch=2, seed=4), torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    got = model.generate(batch, attention_mask=mask, custom_generate=em.custom_generate, tree="auto",
                         head=em.EagleHead.from_target(model), max_new_tokens=6)
    assert torch.equal(got, model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False))
    with pytest.raises(TypeError, match="'auto'"):
        em.speculative_generate(model, head, input_ids=ids, max_new_tokens=4, tree="big")
