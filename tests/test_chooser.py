"""The default call's tree from measured costs: the acceptance model, the choice, the cost file, the no-tree path."""
from __future__ import annotations

import collections
import dataclasses
import json
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import eagle_mm as em
from eagle_mm import TreeConfig
from eagle_mm.decode import chooser as chooser_mod
from eagle_mm.decode import session as session_mod
from eagle_mm.decode.acceptance import (GRID, Acceptance, _grid_rates, expected_lengths, position_rates,
                                       rank_chances)
from eagle_mm.decode.chooser import candidate_trees, rank_trees
from eagle_mm.decode.session import Session
from eagle_mm.decode.cost_cache import VERSION, CostFile, cost_folder
from eagle_mm.decode.costs import CycleCosts, cycle_seconds
from eagle_mm.decode.storage import cache_length, prefill_length
from eagle_mm.decode.stopping import Stops, block_stops, first_stop
from tests.tiny import prompt, tiny_model

KS = (1, 2, 4, 8)


def _costs(batch: int, verify) -> CycleCosts:
    """Stand-in step costs: the verify as ``verify(tokens per row)`` seconds, every other step next to free."""
    qs = (1, 2, 4, 8, 16, 32, 64)
    return CycleCosts(batch, tuple((q, verify(q)) for q in qs),
                      tuple((k, 1e-6, 1e-6) for k in KS), ((2, 1e-6), (9, 1e-6)), 1e-6, qs)


LINEAR = lambda q: 1e-3 * q  # noqa: E731  every verified token costs what the first does (a CPU's compute)
FLAT = lambda q: 1e-3 + 1e-6 * q  # noqa: E731  a few dozen tokens cost what one does (a GPU at a small batch)


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The probe replaced by stand-in costs (and counted), the cost files kept in a fresh folder."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    state = SimpleNamespace(verify=FLAT, calls=[])

    def probe(model, head, cap, batch, *, device, sampler=None, graphs=False, mrope=False):
        state.calls.append(batch)
        return _costs(batch, state.verify)

    monkeypatch.setattr(chooser_mod, "probe", probe)
    return state


def _seen(a: float, t: float, tree: TreeConfig, drafts: int = 4000) -> Acceptance:
    est = Acceptance()
    est.observe(tree, drafts, [round(drafts * r) for r in position_rates(a, t, tree)])
    return est


def _greedy_session(batch: int, captures: bool = False) -> tuple:
    """(chooser, a greedy call's Session at ``batch``) on a fresh tiny target and head; ``captures``: as if its steps
    replayed as CUDA graphs."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    s = Session.start(c, model=model, head=head, cap=None, batch=batch, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=64, max_top_k=96, shrinks=True)
    s.captures = captures
    return c, s


def _no_stats(depth: int = 8) -> SimpleNamespace:
    """A call's ``SpeculativeStats`` before its first cycle (what ``Session.next_tree`` reads)."""
    return SimpleNamespace(num_target_forwards=0, num_drafts=0, accept_counts=[0] * depth, first_counts=[0] * depth,
                           time_draft=0.0, time_verify=0.0, time_other=0.0)


# ---- the acceptance model -------------------------------------------------------------------------
def test_a_chain_commits_the_geometric_sum_and_no_tree_one_token():
    for a in (0.0, 0.3, 0.8):
        got = expected_lengths(a, 0.4, [TreeConfig.chain(5), TreeConfig.none()])
        assert got[TreeConfig.chain(5)] == pytest.approx(sum(a ** i for i in range(6)))
        assert got[TreeConfig.none()] == 1.0


def test_wider_and_larger_trees_commit_more_and_rates_add_up():
    trees = [t for t in candidate_trees() if t.drafts]
    lengths = expected_lengths(0.7, 0.3, trees)
    for tree in trees[::7]:
        rates = position_rates(0.7, 0.3, tree)
        assert lengths[tree] == pytest.approx(1 + sum(rates))
        assert all(x >= y - 1e-12 for x, y in zip(rates, rates[1:]))  # P(L >= i) falls with i
    assert lengths[TreeConfig(4, 4, 16)] > lengths[TreeConfig(4, 2, 8)] > lengths[TreeConfig.chain(4)]
    assert lengths[TreeConfig(6, 8, 48)] > lengths[TreeConfig(6, 8, 24)]
    # The tail only helps a tree: a chain commits the same whatever t is.
    assert expected_lengths(0.7, 0.0, [TreeConfig.chain(4)]) == expected_lengths(0.7, 0.8, [TreeConfig.chain(4)])
    assert (expected_lengths(0.7, 0.6, [TreeConfig(4, 4, 16)])[TreeConfig(4, 4, 16)]
            > expected_lengths(0.7, 0.1, [TreeConfig(4, 4, 16)])[TreeConfig(4, 4, 16)])


def test_the_fit_recovers_the_head_and_follows_a_drift():
    tree, chain = TreeConfig(6, 4, 24), TreeConfig.chain(4)
    est = Acceptance()
    for seen in (tree, chain):
        est.observe(seen, 4000, [round(4000 * r) for r in position_rates(0.7, 0.4, seen, c=0.85)])
    a, t, c = est.fit()
    assert a == pytest.approx(0.7, abs=0.03) and t == pytest.approx(0.4, abs=0.051) and c == pytest.approx(0.85, abs=0.03)
    for _ in range(20):  # the head starts missing: older observations fade
        est.observe(chain, 1000, [round(1000 * r) for r in position_rates(0.2, 0.4, chain)])
    assert est.fit()[0] == pytest.approx(0.2, abs=0.05)
    with pytest.raises(ValueError, match="not acceptance counts"):
        est.observe(TreeConfig.chain(2), 10, [11, 3])
    with pytest.raises(ValueError, match="prior"):
        Acceptance(prior=(0.6, 0.3))


def _first_choice_rates(a: float, t: float, c: float, tree: TreeConfig) -> list[float]:
    """Oracle: P(the path of first choices is accepted to depth i + 1), growing the model's tree node by node (a
    frontier of the top_k best per level, the total_tokens best kept) and following the first choices' path."""
    nodes = [(p, (r,), 1) for r, p in enumerate(rank_chances(a, t, tree.top_k))]
    front = sorted(nodes, key=lambda n: -n[0])[: tree.top_k]
    for d in range(2, tree.depth + 1):
        level = [(p * q, path + (r,), d) for p, path, _ in front for r, q in enumerate(rank_chances(c, t, tree.top_k))]
        nodes += level
        front = sorted(level, key=lambda n: -n[0])[: tree.top_k]
    kept = {path for _, path, _ in sorted(nodes, key=lambda n: -n[0])[: tree.total_tokens]}
    out, ok = [], True
    for d in range(1, tree.depth + 1):
        ok = ok and (0,) * d in kept
        out.append(a * c ** (d - 1) if ok else 0.0)
    return out


@pytest.mark.parametrize("tree", [TreeConfig(3, 6, 24), TreeConfig(4, 2, 4), TreeConfig(5, 8, 48)], ids=str)
def test_first_choices_tell_the_head_s_first_choice_from_its_others(tree):
    """One tree's acceptance counts do not tell a head right at its first choice (a) from one right at its others
    (t): fitted from them alone, several (a, t) fit, the fit may pick the wrong one (an H100's first sampled call
    fitted t = 0 and the chooser drafted chains from then on). The counts of accepted first choices tell them apart;
    the table the fit uses for them equals a node-by-node oracle."""
    a, t, c = 0.5, 0.2, 0.6
    _, table = _grid_rates(tree)
    for g in range(0, len(GRID), 97):  # a spread of the grid, heads whose first choices the tree drops among them
        assert table[g].tolist() == pytest.approx(_first_choice_rates(*GRID[g].tolist(), tree), abs=1e-6), GRID[g]
    n = 100_000
    counts = [round(n * r) for r in position_rates(a, t, tree, c=c)]
    firsts = [round(n * r) for r in _first_choice_rates(a, t, c, tree)]
    est = Acceptance()
    est.observe(tree, n, counts, firsts)
    assert est.fit() == pytest.approx((a, t, c), abs=0.011)
    with pytest.raises(ValueError, match="first-choice counts"):
        Acceptance().observe(tree, 10, [5] * tree.depth, [6] + [0] * (tree.depth - 1))


def test_a_head_surer_below_the_root_is_seen_from_a_shallow_tree_and_its_other_trees_valued():
    """Trained heads accept more often once the first token is right (code-tiny's chain: 0.64, then 0.78-0.97 each
    given the last). Fitted from a shallow tree, the model values other shapes as such a head gets them; one number
    for every level (c = a) fitted to the same counts misses them by a fifth or more."""
    def one_number_fit(seen):
        grid = [(x / 50, y / 10) for x in range(1, 50) for y in range(10)]
        return min(grid, key=lambda p: sum((u - v) ** 2 for u, v in zip(position_rates(*p, seen), rates)))

    for shallow, other in ((TreeConfig.chain(2), TreeConfig(6, 8, 48)), (TreeConfig(3, 8, 48), TreeConfig.chain(6))):
        rates = position_rates(0.6, 0.3, shallow, c=0.9)
        est = Acceptance()
        est.observe(shallow, 4000, [round(4000 * r) for r in rates])
        truth = expected_lengths(0.6, 0.3, [other], c=0.9)[other]
        assert est.expected_lengths([other])[other] == pytest.approx(truth, rel=0.03)
        assert abs(expected_lengths(*one_number_fit(shallow), [other])[other] - truth) > 0.2 * truth


# ---- the choice -----------------------------------------------------------------------------------
def test_no_tree_when_drafting_cannot_pay_a_large_tree_when_verify_is_flat():
    lengths = _seen(0.8, 0.3, TreeConfig(6, 4, 24)).expected_lengths(candidate_trees())
    linear, flat = (rank_trees(lengths, lambda t, f=f: _costs(1, f).step_seconds(t)) for f in (LINEAR, FLAT))
    assert linear[0].tree == TreeConfig.none(), linear[:3]
    assert flat[0].tree.top_k > 1 and flat[0].tree.total_tokens >= 16, flat[:3]
    assert flat[0].tokens_per_second > 3 * next(f for f in flat if not f.tree.drafts).tokens_per_second


def test_a_weak_head_gets_no_tree_even_where_verify_is_flat():
    lengths = _seen(0.02, 0.05, TreeConfig(4, 4, 16)).expected_lengths(candidate_trees())
    ranked = rank_trees(lengths, lambda t: _costs(1, FLAT).step_seconds(t) + (t.depth * 2e-4))
    assert ranked[0].tree == TreeConfig.none()


def test_costs_between_batches_are_interpolated():
    table = {1: _costs(1, FLAT), 16: _costs(16, lambda q: 16e-3 * q)}
    tree = TreeConfig.chain(3)
    one, sixteen = cycle_seconds(table, 1, tree), cycle_seconds(table, 16, tree)
    assert cycle_seconds(table, 8, tree) == pytest.approx(one + (sixteen - one) * 7 / 15)
    assert cycle_seconds(table, 64, tree) == sixteen  # beyond the largest measured: the nearest


def test_timing_noise_never_makes_a_bigger_step_cheaper():
    noisy = _costs(1, lambda q: {1: 3e-3, 2: 2e-3, 4: 4e-3, 8: 8e-3}.get(q, 1.0))
    table = CycleCosts(1, noisy.verify[:4], noisy.draft, noisy.update, noisy.advance)
    seconds = [table.step_seconds(TreeConfig.chain(d)) for d in range(1, 8)]
    assert seconds == sorted(seconds)  # read through the isotonic fit, and extended past the last size timed
    flat_end = CycleCosts(1, ((1, 1e-3), (2, 2e-3), (4, 2e-3)), noisy.draft, noisy.update, 0.0)
    # Past the last size, at least the whole table's slope per token: (2 - 1) ms / 3 tokens.
    assert flat_end.step_seconds(TreeConfig(2, 8, 16)) == pytest.approx(2e-3 + 13 * 1e-3 / 3 + 2e-6 + 1e-6)


def test_a_tree_is_kept_while_it_is_within_5_percent_of_the_best(stand_in):
    """Another tree shape is another graph to capture: a later call keeps the last call's tree unless another
    promises clearly more."""
    stand_in.verify = lambda q: 1e-3 + 2e-4 * q  # each verified token costs a fifth of the forward: depth matters
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kw = dict(model=model, head=head, cap=None, batch=1, gen=SimpleNamespace(do_sample=False),
              sampler=None, mode=None, max_depth=8, max_top_k=96, shrinks=True)
    est, seen = c.acceptance_for(("greedy", None)), TreeConfig.chain(4)

    def head_at(a: float, drafts: int) -> None:
        est.observe(seen, drafts, [round(drafts * r) for r in position_rates(a, 0.3, seen)])

    head_at(0.6, 4000)
    first = Session.start(c, **kw)
    head_at(0.66, 80000)  # a little better: a deeper chain now promises a little more
    again = Session.start(c, **kw)
    best = again.choices[0].finalists
    assert again.tree == first.tree and best[0].tree == first.tree
    assert max(f.tokens_per_second for f in best) > best[0].tokens_per_second  # ... but not 5% more
    head_at(0.9, 80000)
    assert Session.start(c, **kw).tree.depth > first.tree.depth


@pytest.mark.parametrize("per_token, device, seen, drafts", [(1.2e-3, "cpu", 4000, False), (6e-4, "cpu", 4000, True),
                                                             (1.2e-3, "cuda", 4000, True), (1.2e-3, "cpu", 0, True)])
def test_on_a_cpu_a_tree_must_beat_no_tree_by_the_margin(stand_in, per_token, device, seen, drafts):
    """On a CPU a tree expected a few percent above no tree decodes without one (what drafting costs beyond its steps
    is priced from few cycles; such trees lost where tried); one expected clearly above it drafts. On a GPU, whose
    price of no tree is the optimistic one, the rates decide; and before the acceptance is measured (a call without a
    tree would never measure it)."""
    stand_in.verify = lambda q: 1e-3 + per_token * q
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    c.device = torch.device(device)  # nothing here runs on it: the probe is the stand-in
    if seen:
        c.acceptance_for(("greedy", None)).observe(TreeConfig.chain(4), seen, [round(seen * r) for r in
                                                   position_rates(0.6, 0.3, TreeConfig.chain(4))])
    s = Session.start(c, model=model, head=head, cap=None, batch=1, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=8, max_top_k=96, shrinks=True)
    shown = s.choices[0].finalists
    plain = next(f for f in shown if not f.tree.drafts)
    gain = max(f.tokens_per_second for f in shown) / plain.tokens_per_second
    assert (1.0 < gain < session_mod._DRAFT_MARGIN) if per_token > 1e-3 else gain > session_mod._DRAFT_MARGIN, gain
    assert s.tree.drafts is drafts, str(s.choices[0])


def test_the_default_call_picks_from_the_costs(stand_in):
    model, ids = tiny_model("llama"), prompt(9)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    for verify, drafts in ((LINEAR, False), (FLAT, True)):
        stand_in.verify = verify
        head = em.EagleHead.from_target(model)  # a new head: a new chooser (and the costs measured anew)
        for f in cost_folder().glob("*.json"):
            f.unlink()
        out = em.speculative_generate(model, head, ids, max_new_tokens=12, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        first = out.stats.choices[0]
        assert out.stats.tree == first.tree and first.tree.drafts is drafts, str(first)
        assert first.why == "first" and first.finalists[0].tree == first.tree
        assert any(not f.tree.drafts for f in first.finalists)  # no tree is always shown, with its rate
        assert "tok/s" in str(first) and out.stats.as_dict()["choices"][0]["tree"][0] == first.tree.depth


@pytest.mark.parametrize("tree", [TreeConfig.chain(2), TreeConfig(3, 2, 4), TreeConfig.none()], ids=str)
def test_a_users_tree_is_never_overridden(stand_in, tree):
    stand_in.verify = LINEAR if tree.drafts else FLAT  # costs under which the chooser would pick otherwise
    model, ids = tiny_model("llama"), prompt(9, batch=2)
    head = em.EagleHead.from_target(model)
    out = em.speculative_generate(model, head, ids, max_new_tokens=10, tree=tree, return_dict_in_generate=True)
    assert out.stats.tree == tree and out.stats.choices == [] and stand_in.calls == []
    out = em.speculative_generate(model, head, ids, max_new_tokens=10, return_dict_in_generate=True)
    assert out.stats.tree != tree  # what the chooser does with these costs


# ---- the cost file --------------------------------------------------------------------------------
def test_the_cost_file_is_kept_keyed_versioned_and_measured_again_when_damaged(stand_in):
    model, ids = tiny_model("llama"), prompt(9)

    def call():
        head = em.EagleHead.from_target(model)  # a new chooser each time: what a new process sees
        return em.speculative_generate(model, head, ids, max_new_tokens=4, return_dict_in_generate=True)

    call()
    assert stand_in.calls == [1]
    files = list(cost_folder().glob("costs-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["version"] == VERSION and set(data["entries"]) == {"1/greedy"}
    assert {"machine", "torch", "transformers", "target", "head"} <= set(data["key"])
    call()
    assert stand_in.calls == [1]  # read back: nothing measured again
    for damage in ("{not json", json.dumps({**data, "version": VERSION + 1}),
                   json.dumps({**data, "entries": {"1/greedy": {**data["entries"]["1/greedy"], "advance": -1}}}),
                   json.dumps({**data, "key": {**data["key"], "machine": "another"}})):
        files[0].write_text(damage)
        stand_in.calls.clear()
        call()
        assert stand_in.calls == [1]  # measured again...
        assert CostFile(data["key"], cost_folder()).load()  # ...and the file replaced
    # Another target shape is another key: another file.
    em.speculative_generate(tiny_model("llama", num_hidden_layers=2), em.EagleHead.from_target(
        tiny_model("llama", num_hidden_layers=2)), ids, max_new_tokens=4)
    assert len(list(cost_folder().glob("costs-*.json"))) == 2


def test_a_cpu_probe_counts_the_rounds_a_step_already_ran():
    """On a CPU the timers take turns at least once and until each has 3 rounds, those it ran before included (a
    real model's probe was most of its first call); a step slower than the time budget gets no more."""
    from eagle_mm.decode import costs

    class Slow:
        cuda, best = False, float("inf")

        def __init__(self, rounds):
            self.rounds = rounds

        def round(self):
            time.sleep(0.2)  # past the budget of 0.05 s per timer after one turn
            self.rounds += 1
            self.best = min(self.best, 0.2)

    done = [Slow(3), Slow(3)]
    costs._timed(done)
    assert [t.rounds for t in done] == [4, 4]  # one turn: a slow spell falls on both
    fresh = [Slow(0), Slow(3)]
    costs._timed(fresh)
    assert [t.rounds for t in fresh] == [3, 6]


def test_the_probe_leaves_the_global_random_state_alone():
    """A sampled call seeded through torch's global generator draws the same tokens whether or not its first call
    measured the costs: the probe draws its noise from a generator of its own."""
    from transformers import LogitsProcessorList
    from transformers.generation import logits_process as lp

    from eagle_mm.decode.costs import probe
    from eagle_mm.decode.draft import DraftSampler
    from eagle_mm.hf.features import FeatureCapture
    from eagle_mm.hf.parts import resolve_target

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    head.attach(model)
    parts = resolve_target(model)
    sampler = DraftSampler.from_processors(LogitsProcessorList([lp.TopPLogitsWarper(0.9)]), head, None, 8)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with FeatureCapture(parts, head.feature_layers(parts.num_layers)) as cap, torch.no_grad():
        costs = probe(model, head, cap, 2, device=torch.device("cpu"), sampler=sampler)
    assert torch.equal(torch.get_rng_state(), before) and costs.batch == 2


def test_the_few_row_linears_run_only_where_the_probe_measured_them_faster(monkeypatch, tmp_path):
    """skinny.py's few-row product wins on this project's CPU and may lose on another's BLAS: the probe times the
    verify both ways, and the calls run it (and the update) the way that measured faster."""
    from eagle_mm.decode import skinny

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counted = [0]
    real = skinny._linear

    def linear(*args, **kwargs):
        out = real(*args, **kwargs)
        if out is not None:
            counted[0] += 1
            time.sleep(2e-3)  # a machine whose few-row product is slower than F.linear
        return out

    monkeypatch.setattr(skinny, "_linear", linear)
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    ids = prompt(9).expand(2, -1)
    em.speculative_generate(model, head, ids, max_new_tokens=8)
    table = em.decoder(model, head).chooser.table("greedy")
    assert table and all(c.skinny == () for c in table.values()), {b: c.skinny for b, c in table.items()}
    counted[0] = 0
    out = em.speculative_generate(model, head, ids, max_new_tokens=8)
    assert counted[0] == 0
    assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("tree", [TreeConfig.chain(2), TreeConfig.none()], ids=str)
def test_a_users_tree_runs_the_few_row_linears_only_where_a_probe_measured_them_faster(monkeypatch, tmp_path, tree):
    """A user's tree ran the few-row product wherever there were a few rows: on this project's CPU in 2026-12 that
    made code-tiny's plain decoding at batch 4 1.6-1.8x slower than without it. Now it follows the costs a default call
    measured here, and runs F.linear (``generate``'s own) where none were."""
    from eagle_mm.decode import skinny

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    calls = []
    real = skinny._linear
    monkeypatch.setattr(skinny, "_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    ids = prompt(9).expand(2, -1)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(em.speculative_generate(model, head, ids, max_new_tokens=8, tree=tree), ref)
    assert calls == []  # nothing measured: F.linear
    chooser = em.decoder(model, head).chooser
    for pays in (True, False):  # as a default call's probe found them: faster (every size), or slower
        chooser.entries = {"1/greedy": dataclasses.replace(_costs(1, FLAT), skinny=_costs(1, FLAT).skinny if pays
                                                           else ())}
        calls.clear()
        assert torch.equal(em.speculative_generate(model, head, ids, max_new_tokens=8, tree=tree), ref)
        assert bool(calls) == pays


def test_a_tree_s_step_seconds_follow_the_costs(stand_in):
    """The chooser prices each tree's steps once per batch and costs (a choice ranks a few hundred trees): new costs,
    measured or set, are priced anew."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)  # the decoder holds its model and head weakly
    c = em.decoder(model, head).chooser
    tree = TreeConfig(4, 4, 16)
    prices = []
    for verify in (FLAT, LINEAR, FLAT):
        c.entries = {"1/greedy": _costs(1, verify), "4/greedy": _costs(4, verify)}
        table = c.table("greedy")
        prices.append(c.seconds(table, "greedy", 2)(tree))
        assert prices[-1] == pytest.approx(cycle_seconds(table, 2, tree))
        assert c.seconds(table, "greedy", 2)(tree) == prices[-1]  # priced once, the same again
    assert prices[0] != prices[1] and prices[0] == pytest.approx(prices[2])


def test_cycle_costs_refuse_bad_data():
    good = _costs(2, FLAT).as_json()
    assert CycleCosts.from_json(json.loads(json.dumps(good))) == _costs(2, FLAT)
    for bad in ({**good, "batch": 0}, {**good, "verify": [[1, float("nan")]]}, {**good, "verify": [[2, 1e-3], [1, 1e-3]]},
                {**good, "draft": [[1, 1e-3]]}, {**good, "overhead": "1"}, {k: v for k, v in good.items() if k != "update"},
                {**good, "skinny": [3]}, {**good, "skinny": "all"}):
        with pytest.raises(ValueError):
            CycleCosts.from_json(bad)


def test_a_cost_folder_others_may_write_is_not_used(tmp_path):
    folder = tmp_path / "costs"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    file = CostFile({"k": 1}, folder)
    file.save({"1/greedy": _costs(1, FLAT)})
    assert not file.path.exists() and file.load() == {}


# ---- the no-tree path and the switches, through the engine -----------------------------------------
def _ragged(model, ids: torch.Tensor, n: int) -> dict:
    """generate() options under which the rows of ``ids`` stop at different times: an end-of-sequence token that
    the rows' greedy continuations reach at the most different places (some not within ``n`` tokens)."""
    new = model.generate(ids, max_new_tokens=n, do_sample=False)[:, ids.shape[1]:]
    first = {}
    for tok in new.unique().tolist():
        at = [(row == tok).nonzero()[0, 0].item() if (row == tok).any() else n for row in new]
        first[tok] = len(set(at))
    eos = max(sorted(first), key=first.get)
    return dict(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)


@pytest.mark.parametrize("batch", [1, 4])
def test_no_tree_equals_generate(batch):
    model, ids = tiny_model("llama"), prompt(9, batch=batch, seed=3)
    head = em.Eagle3Head.from_target(model)
    # With several rows, they finish at different times: the engine drops them as it goes.
    kw = _ragged(model, ids, 20) if batch > 1 else dict(max_new_tokens=20, do_sample=False)
    ref = model.generate(ids, **kw)
    for storage in (None, "dynamic"):
        out = em.speculative_generate(model, head, ids, tree=TreeConfig.none(), cache_implementation=storage,
                                      return_dict_in_generate=True, **kw)
        assert torch.equal(out.sequences, ref), storage
        assert out.stats.mean_accept_length == 1.0 and out.stats.num_draft_tokens == 0


def test_sampled_no_tree_engine_equals_fallback():
    model, ids = tiny_model("llama"), prompt(9, batch=2)
    head = em.EagleHead.from_target(model)
    outs = [em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=True, top_p=0.9,
                                    tree=TreeConfig.none(), cache_implementation=storage,
                                    generator=torch.Generator().manual_seed(4)) for storage in (None, "dynamic")]
    assert torch.equal(*outs)


class _Scripted:
    """A stand-in session: the trees of ``script`` in turn, one per cycle, within their envelope."""

    script: list = []

    def __init__(self):
        self.i, self.choices = 0, []
        self.tree, self.capacity = self.script[0], TreeConfig(4, 3, 8)

    @classmethod
    def start(cls, chooser, **kw):
        return cls()

    def next_tree(self, batch, stats, setup, remaining=None, generation=None):
        self.i += 1
        self.tree = self.script[self.i % len(self.script)]
        return self.tree

    def finish(self, stats, setup, longest=None):
        pass

    def few_row_linears(self, batch, q):
        return True

    def shrink_pays(self, batch, rows, remaining):
        return True


@pytest.mark.parametrize("batch", [1, 3])
def test_switching_trees_mid_call_keeps_generate_tokens(monkeypatch, batch):
    """No tree, chains and trees in turn, cycle after cycle, within buffers sized once: every switch (a draft from
    a head left as it was by cycles without a tree, too) keeps the target's tokens."""
    from eagle_mm.decode import loop

    _Scripted.script = [TreeConfig.none(), TreeConfig.chain(2), TreeConfig(3, 3, 8), TreeConfig.none(),
                        TreeConfig.none(), TreeConfig(4, 2, 6), TreeConfig.chain(1)]
    monkeypatch.setattr(loop, "Session", _Scripted)
    model, ids = tiny_model("llama"), prompt(9, batch=batch, seed=5)
    head = em.EagleHead.from_target(model)
    kw = _ragged(model, ids, 30) if batch > 1 else dict(max_new_tokens=30, do_sample=False)
    out = em.speculative_generate(model, head, ids, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, model.generate(ids, **kw))
    assert out.stats.num_target_forwards >= len(_Scripted.script)


def test_rows_finishing_make_the_choice_again(stand_in):
    model, ids = tiny_model("llama"), prompt(9, batch=4, seed=6)
    kw = _ragged(model, ids, 16)
    out = em.speculative_generate(model, em.EagleHead.from_target(model), ids, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, model.generate(ids, **kw))
    assert stand_in.calls == [1, 4]  # the call's batch, and one row for when rows finish
    batches = [c.batch for c in out.stats.choices]
    assert batches[0] == 4 and batches[1:] and all(b < 4 for b in batches[1:])
    assert all(c.why == "rows finished" for c in out.stats.choices[1:])


def test_a_call_that_starts_without_a_tree_stays_without_one(stand_in):
    """It leaves the head out (no pass over the prompt), so nothing could draft later in the call: rows finishing
    where a tree would pay do not switch it; the next call chooses again."""
    stand_in.verify = LINEAR
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kw = dict(model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False),
              sampler=None, mode=None, max_depth=8, max_top_k=96, shrinks=True)
    s = Session.start(c, **kw)
    assert not s.tree.drafts and s.idle
    s.table = {b: _costs(b, FLAT) for b in (1, 4)}  # costs under which one row would draft
    stats = _no_stats()
    assert not s.next_tree(1, stats, 0.0).drafts and s.choices[-1].why == "rows finished"
    c.entries.clear()
    stand_in.verify = FLAT
    assert Session.start(c, **kw).tree.drafts


def test_a_call_without_a_tree_sizes_its_cache_for_the_tokens_it_commits(stand_in):
    """A call that never drafts holds no room for trees: every forward attends over all of the cache's slots (at
    batch 64 on the H200 the default call's no-tree step took 1.30 ms of GPU time, an explicit
    ``TreeConfig.none()``'s 1.20). A later call that drafts sizes the cache for its trees again, and from then on
    a call without a tree at that batch keeps it."""
    stand_in.verify = LINEAR
    model, ids = tiny_model("llama"), prompt(9, batch=4, seed=6)
    head = em.EagleHead.from_target(model)
    store = em.decoder(model, head).storage
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    ref = model.generate(ids, **kw)
    out = em.speculative_generate(model, head, ids, return_dict_in_generate=True, **kw)
    assert not out.stats.tree.drafts and torch.equal(out.sequences, ref)
    plain = cache_length(prefill_length(9), prefill_length(9) + 24, 4, 1, 0)
    assert store.length == plain
    em.decoder(model, head).chooser.entries.clear()
    stand_in.verify = FLAT
    out = em.speculative_generate(model, head, ids, return_dict_in_generate=True, **kw)
    assert out.stats.tree.drafts and torch.equal(out.sequences, ref)
    assert store.length > plain
    # Back without a tree at that batch: it keeps the storage sized for trees (a new size would allocate anew and
    # capture every step again; calls with and without a tree by turns did so in every call).
    em.decoder(model, head).chooser.entries.clear()
    stand_in.verify = LINEAR
    sized, generation = store.length, store.generation
    out = em.speculative_generate(model, head, ids, return_dict_in_generate=True, **kw)
    assert not out.stats.tree.drafts and torch.equal(out.sequences, ref)
    assert (store.length, store.generation) == (sized, generation)


def test_acceptance_moving_makes_the_choice_again(stand_in, monkeypatch):
    """Cycles that accept every draft token raise the fitted acceptance until a bigger tree promises more."""
    monkeypatch.setattr(session_mod, "_REFIT_SECONDS", 0.0)
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    c.acceptance_for(("greedy", None)).observe(TreeConfig(2, 4, 8), 640, [80, 10])  # a weak head so far
    s = Session.start(c, model=model, head=head, cap=None, batch=1, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=8, max_top_k=96, shrinks=True)
    first = s.tree
    stats = _no_stats(s.capacity.depth)
    for _ in range(200):
        tree = s.next_tree(1, stats, 0.0)
        if tree != first:
            break
        stats.num_target_forwards += 1
        stats.num_drafts += 1
        stats.accept_counts = [n + 1 if i < tree.depth else n for i, n in enumerate(stats.accept_counts)]
        stats.time_verify += 1e-3
    assert tree != first and s.choices[-1].why == "acceptance or costs moved", [str(x) for x in s.choices]
    assert tree.fits(s.capacity) and tree.depth > first.depth  # a head that is right more often: deeper


def _call(s: Session, batch: int, cycles: int, accept: float, seconds: float, setup: float = 0.0,
          compiled: float = 0.0) -> None:
    """A stand-in call of ``s``: ``cycles`` cycles at ``accept`` tokens each that took ``seconds`` in all, of which
    ``compiled`` went to captures."""
    s.next_tree(batch, _no_stats(), setup)
    done = SimpleNamespace(num_target_forwards=cycles, num_drafts=cycles * batch, accept_counts=[0] * 8,
                           first_counts=[0] * 8, mean_accept_length=accept, time_draft=0.0, time_verify=seconds,
                           time_other=0.0, time_compile=compiled)
    s.finish(done, setup + compiled, round(cycles * accept))


def test_a_tree_measured_losing_its_calls_gives_way_to_no_tree_and_back(stand_in):
    """The probe and the per-cycle share cannot see a batch's tail (its slowest row keeps every cycle going):
    what whole calls took against their prediction scales the next choices, with a tree and without."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    # mode "graphs" (not captured on a CPU): a first call of a shape is not counted there, as on a GPU
    kw = dict(model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False),
              sampler=None, mode="graphs", max_depth=64, max_top_k=96, shrinks=True)
    s = Session.start(c, **kw)
    assert s.tree.drafts
    ahead = s.choices[0].finalists[0].tokens_per_second / next(
        f for f in s.choices[0].finalists if not f.tree.drafts).tokens_per_second
    _call(s, 4, 16, 2.0, 16 * s._plan[2] * 9)  # a process's first call of a shape is not counted
    assert c.ratio(s.kind, 4, s.setting, True) == 1.0
    s = Session.start(c, **kw)
    _call(s, 4, 16, 2.0, 16 * s._plan[2] * 2 * ahead)  # the call took twice its lead: drafting lost
    assert c.ratio(s.kind, 4, s.setting, True) == pytest.approx(1 + (2 * ahead - 1) / 2)  # one call: halfway
    plain = Session.start(c, **kw)
    assert not plain.tree.drafts and plain.idle
    _call(plain, 4, 32, 1.0, 32 * plain._plan[2] * 4 * ahead)  # its first call without a tree: not counted
    assert not Session.start(c, **kw).tree.drafts
    plain = Session.start(c, **kw)
    _call(plain, 4, 32, 1.0, 32 * plain._plan[2] * 4 * ahead)  # ... and then plain decoding lost by more
    assert Session.start(c, **kw).tree.drafts
    assert c.ratio(plain.kind, 1, plain.setting, True) == 1.0  # another batch has its own


def test_a_call_that_captured_says_nothing_of_the_next(stand_in):
    """A first call of a shape captures graphs and pays first-use costs beyond them (on the H200 a tree's first call
    took 7x its prediction and every later call then decoded without a tree): only calls that captured nothing
    scale later choices."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kw = dict(model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False),
              sampler=None, mode=None, max_depth=64, max_top_k=96, shrinks=True)
    s = Session.start(c, **kw)
    assert s.tree.drafts
    _call(s, 4, 16, 2.0, 16 * s._plan[2])  # the first call of the shape (not counted either)
    s = Session.start(c, **kw)
    _call(s, 4, 16, 2.0, 16 * s._plan[2] * 7, compiled=0.25)
    assert c.ratio(s.kind, 4, s.setting, True) == 1.0
    assert Session.start(c, **kw).tree == s.tree
    again = Session.start(c, **kw)
    _call(again, 4, 16, 2.0, 16 * again._plan[2] * 7 / 2.0)  # the same call without captures: 3.5x slower
    assert c.ratio(s.kind, 4, s.setting, True) > 1.0


def test_drafting_cycles_host_share_is_not_charged_to_no_tree(stand_in):
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    s = Session.start(c, model=model, head=head, cap=None, batch=1, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=64, max_top_k=96, shrinks=True)
    assert s.tree.drafts
    steps = cycle_seconds(s.table, 1, s.tree)
    stats = _no_stats(s.capacity.depth)
    for _ in range(5):  # cycles that each took 5 ms beyond their steps
        s.next_tree(1, stats, 0.0)
        stats.num_target_forwards += 1
        stats.num_drafts += 1
        stats.time_verify += steps + 5e-3
    s.next_tree(1, stats, 0.0)
    seconds = c.seconds(s.table, s.kind, 1)
    assert seconds(s.tree) == pytest.approx(steps + 5e-3)
    assert seconds(TreeConfig.none()) == pytest.approx(cycle_seconds(s.table, 1, TreeConfig.none()))


@pytest.mark.parametrize("keeps_tree", [False, True], ids=["new choice", "tree kept (captured steps)"])
def test_the_cycle_after_rows_finish_teaches_no_host_share(stand_in, keeps_tree):
    """The first cycle at a new batch pays the move (rows dropped, the cache compacted, a new choice): one such
    cycle, the only one without a tree at batch 2, priced no tree there at twice its cost on this project's CPU. So
    too where the call keeps its tree as rows finish (its steps replay as CUDA graphs)."""
    c, s = _greedy_session(4, captures=keeps_tree)
    tree = s.tree
    stats = _no_stats(s.capacity.depth)

    def cycle(batch: int, beyond: float) -> None:  # the cycle after this look takes ``beyond`` past its steps
        s.next_tree(batch, stats, 0.0)
        stats.num_target_forwards += 1
        stats.num_drafts += 1
        stats.time_verify += cycle_seconds(s.table, batch, s.tree) + beyond

    for _ in range(3):
        cycle(4, 5e-3)
    cycle(2, 50e-3)  # rows finished: the first cycle at batch 2 pays the move
    assert (s.tree == tree) if keeps_tree else True
    s.next_tree(2, stats, 0.0)
    assert (s.kind, 2, s.tree.drafts) not in c.overhead
    cycle(2, 5e-3)
    s.next_tree(2, stats, 0.0)
    assert c.overhead[(s.kind, 2, s.tree.drafts)] == pytest.approx(5e-3)


def test_on_a_gpu_a_cycle_without_a_tree_takes_the_drafting_cycles_host_share_until_it_learns_its_own(stand_in):
    """A plain cycle's host share left at 0 beside a tree's learned one made no tree look cheaper than it is: the
    H200's first calls at every batch above 1 switched to it at their first review, and later calls kept it."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    c.device = torch.device("cuda")  # the share is borrowed on a GPU only (nothing here runs on it)
    kind = "greedy"
    c.entries = {"1/greedy": _costs(1, FLAT), "4/greedy": _costs(4, FLAT)}
    table = c.table(kind)
    none, tree = TreeConfig.none(), TreeConfig(4, 4, 16)
    c.overhead[(kind, 1, True)] = 4e-3  # learned by drafting cycles at batch 1
    seconds = c.seconds(table, kind, 4)
    assert seconds(none) == pytest.approx(cycle_seconds(table, 4, none) + 4e-3)
    assert seconds(tree) == pytest.approx(cycle_seconds(table, 4, tree) + 4e-3)
    c.overhead[(kind, 4, False)] = 1e-3  # plain cycles at batch 4 learn their own
    assert c.seconds(table, kind, 4)(none) == pytest.approx(cycle_seconds(table, 4, none) + 1e-3)
    c.device = torch.device("cpu")
    del c.overhead[(kind, 4, False)]
    assert c.seconds(table, kind, 4)(none) == pytest.approx(cycle_seconds(table, 4, none))


def test_on_a_cpu_a_tree_takes_the_plain_cycles_host_share_until_it_learns_its_own(stand_in):
    """All that a plain cycle does beyond the steps a drafting cycle does too: a tree not run yet is priced with
    it (the reverse would charge a plain cycle a head's host work)."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kind = "greedy"
    c.entries = {"4/greedy": _costs(4, FLAT)}
    table = c.table(kind)
    tree = TreeConfig(4, 4, 16)
    c.overhead[(kind, 4, False)] = 2e-3
    seconds = c.seconds(table, kind, 4)
    assert seconds(tree) == pytest.approx(cycle_seconds(table, 4, tree) + 2e-3)
    c.overhead[(kind, 4, True)] = 5e-3
    assert c.seconds(table, kind, 4)(tree) == pytest.approx(cycle_seconds(table, 4, tree) + 5e-3)


def test_an_untried_tree_is_priced_at_least_as_plain_calls_realized(stand_in):
    """Calls without a tree that took longer than predicted: a tree not measured at that batch yet takes their
    ratio (its cycles do what theirs do, and more), not 1, on a CPU; below 1, or on a GPU, 1; once measured, its
    own."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    key = ("greedy", 4, ("greedy", None))
    c.realized[key + (False,)] = collections.deque([1.2, 1.2])
    assert c.ratio(*key, True) == pytest.approx(1 + 0.2 * 2 / 3) == c.ratio(*key, False)
    c.realized[key + (False,)] = collections.deque([0.8])
    assert c.ratio(*key, True) == 1.0
    c.realized[key + (False,)] = collections.deque([1.2, 1.2])
    c.device = torch.device("cuda")  # a GPU's plain cycles took longer by the host's share, which is not scaled
    assert c.ratio(*key, True) == 1.0
    c.realized[key + (True,)] = collections.deque([0.9])
    assert c.ratio(*key, True) == pytest.approx(0.95)


def test_the_capacity_holds_every_candidate_whatever_the_acceptance(stand_in):
    """Calls of one batch size their buffers alike: a capacity that followed the fitted acceptance grew from call to
    call, and each new size allocated new buffers (and captured every step again)."""
    stand_in.verify = lambda q: 1e-3 + 2e-4 * q  # each verified token costs a fifth of the forward
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kw = dict(model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False),
              sampler=None, mode=None, max_depth=8, max_top_k=96, shrinks=True)
    c.acceptance_for(("greedy", None)).observe(TreeConfig.chain(2), 4000, [1600, 300])  # a weak head so far
    weak = Session.start(c, **kw)
    c.acceptance_for(("greedy", None)).observe(TreeConfig.chain(4), 80000, [79000, 78000, 77000, 76000])
    strong = Session.start(c, **kw)
    assert strong.tree != weak.tree and strong.capacity == weak.capacity
    assert all(t.fits(weak.capacity) for t in candidate_trees(8, 8))


def _graph_session(stand_in, remaining: int):
    """A session whose steps replay as CUDA graphs (captures cost ``capture`` seconds), at batch 1."""
    stand_in.verify = lambda q: 1e-3 + 2e-4 * q
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    s = Session.start(c, model=model, head=head, cap=None, batch=1, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=8, max_top_k=96, shrinks=True)
    s.captures, s.remaining = True, remaining
    return c, s


@pytest.mark.parametrize("remaining", [8, 100000])
def test_a_tree_new_at_a_batch_must_pay_for_its_capture(stand_in, remaining):
    """Where the steps replay as CUDA graphs, the held tree stays unless another finishes the tokens left sooner by
    more than its capture costs: a few tokens never pay for one, many do."""
    c, s = _graph_session(stand_in, remaining)
    ranked = s.rank(1)
    held = next(f for f in ranked[1:] if f.tree.drafts and f.tokens_per_second < 0.9 * ranked[0].tokens_per_second)
    c.hold(s.kind, 1, held.tree)
    c.captures[s.kind] = collections.deque([0.2])  # a capture watched: 0.2 s
    c.last.clear()
    chosen = s._choose(1, "first").tree
    assert chosen == (held.tree if remaining == 8 else ranked[0].tree)


def _stats(forwards: int) -> SimpleNamespace:
    return SimpleNamespace(num_target_forwards=forwards, num_drafts=forwards, accept_counts=[0] * 8,
                           first_counts=[0] * 8, time_draft=0.0, time_verify=1e-3 * forwards, time_other=0.0)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_under_cuda_graphs_a_call_keeps_its_tree_as_rows_finish(stand_in, graphs):
    """Replayed as CUDA graphs, a call keeps its first tree as its batch shrinks (its choice counted the captures at
    the smaller batches): a new choice at each batch made each call's path of trees differ from the last call's, and
    timed calls captured again. Eagerly, nothing is captured: it chooses again at the new batch."""
    c, s = _greedy_session(16, captures=graphs)
    first = s.tree
    s.next_tree(16, _stats(0), 0.0)
    s.next_tree(16, _stats(1), 0.0)
    got = s.next_tree(4, _stats(2), 0.0)
    if graphs:
        assert got == first and len(s.choices) == 1
        assert {(s.kind, 16, first), (s.kind, 4, first)} <= set(c.held)
    else:
        assert [ch.why for ch in s.choices] == ["first", "rows finished"] and s.choices[-1].batch == 4


def test_a_capture_is_charged_at_the_calls_batch(stand_in):
    """A tree's capture costs the call at its batch, where the runner holds no graphs of it yet, a call without a
    tree likewise; not at the smaller batches the call may shrink to (it shrinks only where that pays for a capture:
    ``shrink_pays``). Where nothing is held at the batch, every tree captures: nothing is charged, the rates decide."""
    c, s = _graph_session(stand_in, 100)
    c.captures[s.kind] = collections.deque([0.2])
    tree = TreeConfig.chain(3)
    assert s._charge(16)(tree) == 0.0
    c.hold(s.kind, 16, tree)
    c.hold(s.kind, 8, TreeConfig.chain(2))
    assert s._charge(16)(tree) == 0.0 and s._charge(16)(TreeConfig.chain(2)) == pytest.approx(0.2)
    assert s._charge(16)(TreeConfig.none()) == pytest.approx(0.2) and s._charge(8)(TreeConfig.chain(2)) == 0.0


def test_rows_finishing_shrink_the_batch_only_where_it_pays_for_a_capture(stand_in):
    """Under CUDA graphs a call goes on at fewer rows once rows finished where it holds the graphs there, or where the
    fewer rows save more over the tokens left than a capture costs; else it keeps its batch. Eagerly it always
    shrinks (nothing to capture)."""
    c, s = _graph_session(stand_in, 8)
    s.table = {1: _costs(1, lambda q: 1e-3), 16: _costs(16, lambda q: 5e-3)}  # 16 rows cost 5x one row
    c.captures[s.kind] = collections.deque([0.2])
    assert not s.shrink_pays(16, 8, 8)  # 8 tokens left: a few ms saved against a 0.2 s capture
    assert s.shrink_pays(16, 8, 100000)
    c.hold(s.kind, 8, s.tree)
    assert s.shrink_pays(16, 8, 8)  # held there: nothing to capture
    s.captures = False
    assert s.shrink_pays(16, 4, 8)


def _finished(forwards: int, accept: float, seconds: float | None = None) -> SimpleNamespace:
    stats = SimpleNamespace(**vars(_stats(forwards)), mean_accept_length=accept, time_compile=0.0)
    if seconds is not None:
        stats.time_verify = seconds
    return stats


def test_a_batch_waiting_for_its_slowest_row_prices_its_trees_by_it(stand_in):
    """A drafting call that took more cycles than its mean accepted length says (its rows accept at different rates
    and the batch decodes until the slowest is done) makes the drafting trees' tokens per cycle at that batch that
    much fewer; no tree's stay (its rows commit one token each)."""
    c, s = _graph_session(stand_in, 100)
    s.next_tree(1, _stats(0), 0.0)
    assert s.tree.drafts and c.straggling(s.kind, 1, s.setting) == 1.0
    before = {f.tree: f.accept_length for f in s.rank(1)}
    s.finish(_finished(40, 4.0), 0.0, 128)  # 128 tokens at 4 a cycle are 32 cycles: it took 40
    assert c.straggling(s.kind, 1, s.setting) == pytest.approx(1.25)
    after = {f.tree: f.accept_length for f in s.rank(1)}
    assert all(after[t] == pytest.approx(n / 1.25 if t.drafts else n) for t, n in before.items())


def test_a_batch_not_measured_yet_straggles_at_least_as_the_smaller_ones_measured(stand_in):
    """More rows wait for a slower slowest row: before any call at a batch, its straggling is the most measured at a
    smaller batch of the kind and setting (not a larger batch's, nor another setting's); once measured, its own."""
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kind, greedy, sampled = "greedy", ("greedy", None), ("sampled", None)
    c.straggle[(kind, 2, greedy)] = collections.deque([1.2])
    c.straggle[(kind, 4, greedy)] = collections.deque([1.5, 1.4, 1.6])
    c.straggle[(kind, 32, greedy)] = collections.deque([2.0])
    c.straggle[(kind, 8, sampled)] = collections.deque([3.0])
    assert c.straggling(kind, 16, greedy) == pytest.approx(1.5)
    assert c.straggling(kind, 3, greedy) == pytest.approx(1.2)
    assert c.straggling(kind, 1, greedy) == 1.0
    assert c.straggling("sampled-graphs", 16, greedy) == 1.0
    c.straggle[(kind, 16, greedy)] = collections.deque([1.1])
    assert c.straggling(kind, 16, greedy) == pytest.approx(1.1)


def test_a_calls_realized_time_is_weighed_per_cycle(stand_in):
    """What a call (not its shape's first) took against its first choice's cycle times the cycles it ran: 1.5x
    slower cycles read 1.5, whatever the straggling."""
    c, s = _graph_session(stand_in, 100)
    s.next_tree(1, _stats(0), 0.0)
    _, drafts, cycle = s._plan
    c.called = frozenset({(s.kind, 1, s.setting, drafts)})
    s.finish(_finished(40, 4.0, seconds=40 * cycle * 1.5), 0.0, 128)
    assert c.realized[(s.kind, 1, s.setting, drafts)][-1] == pytest.approx(1.5)


def test_a_call_that_went_on_at_fewer_rows_is_weighed_by_the_cycles_it_ran(stand_in, monkeypatch):
    """Each cycle is predicted at the batch and tree it ran: a call that drafted at 4 rows, then went on at 1 row
    (cheaper cycles, eagerly) and took just what those cycles predict reads 1, not the fraction of the 4-row cycles'
    price it would read against its first choice alone; and its straggling counts, though it left its tree."""
    def probe(model, head, cap, batch, **kw):  # a CPU's: a cycle's cost follows its rows and tokens; drafting pays
        return _costs(batch, lambda q: batch * (1e-3 + 2e-4 * q))

    monkeypatch.setattr(chooser_mod, "probe", probe)
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    s = Session.start(c, model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=64, max_top_k=96, shrinks=True)
    c.acceptance_for(s.setting).observe(TreeConfig.chain(3), 4000, [3900, 3800, 3700])
    s = Session.start(c, model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=64, max_top_k=96, shrinks=True)
    assert s.tree.drafts
    stats, spent = _stats(0), 0.0
    for i in range(40):
        tree = s.next_tree(4 if i < 10 else 1, stats, 0.0)
        spent += c.seconds(s.table, s.kind, 4 if i < 10 else 1)(tree)
        stats = _stats(i + 1)
    assert s.choices[-1].batch == 1
    stats.time_verify, stats.mean_accept_length, stats.time_compile = spent, 2.0, 0.0
    s.finish(stats, 0.0, 40)
    assert c.realized[(s.kind, 4, s.setting, True)][-1] == pytest.approx(1.0, rel=0.05)
    assert c.straggle[(s.kind, 4, s.setting)][-1] == pytest.approx(2.0)


@pytest.mark.parametrize("mode", [None, "graphs"])
def test_a_first_call_counts_where_it_ran_eagerly(stand_in, mode):
    """A shape's first call is counted in the realized times where its steps ran eagerly (nothing to build or
    capture), not where they replay as CUDA graphs (its first-use costs go beyond its captures)."""
    c, s = _graph_session(stand_in, 100)
    s.mode = mode
    s.next_tree(1, _stats(0), 0.0)
    _, drafts, cycle = s._plan
    s.finish(_finished(40, 4.0, seconds=40 * cycle * 1.5), 0.0, 128)
    assert (c.realized.get((s.kind, 1, s.setting, drafts)) is not None) == (mode is None)


@pytest.mark.parametrize("below, shrinks, measures", [(1e9, True, True), (0.0, True, False), (1e9, False, False)],
                         ids=["measures", "a-tree-that-clearly-wins", "compiled"])
def test_a_drafting_call_decodes_its_last_tokens_without_a_tree_to_measure_it(stand_in, monkeypatch, below, shrinks,
                                                                              measures):
    """Where no cycle without a tree has been watched at a batch and kind, a call that drafts decodes its last
    ``_MEASURE_TOKENS`` tokens per row without one, to its end (rows finishing too), to measure it (priced until then at
    a tree's host share), unless a tree promises ``_MEASURE_PLAIN_BELOW`` times its rate or the call is compiled (it
    keeps its tree); the next call has it measured and keeps to the tree the call chose."""
    monkeypatch.setattr(session_mod, "_MEASURE_PLAIN_BELOW", below)
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    start = dict(model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False), sampler=None,
                 mode=None, max_depth=64, max_top_k=96, shrinks=shrinks)
    s = Session.start(c, **start)
    tree, key = s.tree, (4, s.kind, s.setting)
    assert tree.drafts and s.measure == measures
    stats = _no_stats(s.capacity.depth)
    trees = []
    for left in (40, 30, 20, 13, 12, 11, 9, 8, 6, 5, 3, 2, 1):
        trees.append(s.next_tree(4 if left > 6 else 2, stats, 0.0, left))
        stats.num_target_forwards += 1
        stats.num_drafts += 4
        stats.accept_counts = [n + 4 for n in stats.accept_counts]  # a head right every time
        stats.first_counts = [n + 4 for n in stats.first_counts]
        stats.time_verify += 2e-3
    if not measures:
        assert all(t.drafts for t in trees) and (s.kind, 4, False) not in c.overhead
        return
    assert trees[:4] == [tree] * 4 and trees[4:] == [TreeConfig.none()] * 9
    assert [ch.why for ch in s.choices] == ["first", session_mod._MEASURING]
    assert c.last[key] == tree  # the tree the call chose, not the measurement's
    assert (s.kind, 4, False) in c.overhead  # the cycles at 4 rows (at 2 a cycle or two: not yet a median)
    again = Session.start(c, **start)
    assert not again.measure and again.tree == tree


def test_under_cuda_graphs_only_a_first_call_or_held_graphs_measure_no_tree(stand_in, monkeypatch):
    """Under CUDA graphs the measuring tail would capture the steps without a tree: a first call at the batch measures
    (it captures anyway), a later one only where the runner holds those graphs there."""
    monkeypatch.setattr(session_mod, "_MEASURE_PLAIN_BELOW", 1e9)
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    s = Session.start(c, model=model, head=head, cap=None, batch=4, gen=SimpleNamespace(do_sample=False),
                      sampler=None, mode=None, max_depth=64, max_top_k=96, shrinks=True)
    first = s.choices[0]
    assert first.tree.drafts and s._plain_unmeasured(4, first)  # eager steps: nothing to capture
    s.captures = True
    assert s._plain_unmeasured(4, first)  # the first call at 4 rows
    c.hold(s.kind, 4, first.tree)  # a later call: the runner holds the tree's graphs at 4 rows
    assert not s._plain_unmeasured(4, first)  # ... and the tail would capture
    c.hold(s.kind, 4, TreeConfig.none())
    assert s._plain_unmeasured(4, first)  # the graphs are held: the tail replays them


def test_the_held_graphs_follow_the_storage_and_the_runners_limit(stand_in):
    c, s = _graph_session(stand_in, 100)
    c.sync(1)
    for b in range(chooser_mod.MAX_GRAPHS + 2):
        c.hold(s.kind, b + 1, TreeConfig.chain(2))
    assert len(c.held) == chooser_mod.MAX_GRAPHS and (s.kind, 1, TreeConfig.chain(2)) not in c.held
    c.sync(2)  # new memory: its graphs are captured anew
    assert not c.held


def test_a_storage_grown_in_a_cycle_moves_the_held_graphs_with_it(stand_in):
    """A cache that grows within a cycle (its last, say) drops the graphs of the old memory and captures the cycle's
    steps on the new: the mirror follows at once, so that the next call at that batch is not charged the capture of
    the tree it replays (nor after another call at that batch that holds the same memory)."""
    c, s = _graph_session(stand_in, 100)
    c.captures[s.kind] = collections.deque([0.2])
    s.next_tree(1, _stats(0), 0.0, generation=1)
    assert (s.kind, 1, s.tree) in c.held
    s.moved(2)
    assert c.generation == 2 and list(c.held) == [(s.kind, 1, s.tree)]
    c.sync(2)  # the next call's first look: the same memory
    c.hold(s.kind, 1, TreeConfig.none())
    assert s._charge(1)(s.tree) == 0.0 and s._charge(1)(TreeConfig.chain(7)) == pytest.approx(0.2)


def test_compiled_calls_keep_their_tree(stand_in):
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kw = dict(model=model, head=head, cap=None, batch=2, gen=SimpleNamespace(do_sample=False),
              sampler=None, mode="default", max_depth=8, max_top_k=96, shrinks=False)
    first = Session.start(c, **kw)
    stand_in.verify = LINEAR  # costs that would pick otherwise: a compiled call keeps what it compiled for
    c.entries.clear()
    again = Session.start(c, **kw)
    assert again.tree == first.tree and again.choices[0].why == "kept (compiled)"
    stats = SimpleNamespace(num_target_forwards=1, num_drafts=1, accept_counts=[0] * 8, first_counts=[0] * 8,
                            time_draft=0.0, time_verify=0.0, time_other=0.0)
    assert again.next_tree(1, stats, 0.0) == first.tree  # nor does it switch within the call


def test_a_sampled_compiled_call_chooses_its_own_tree_not_the_greedy_calls(stand_in):
    """Compiled calls keep their tree per decoding kind: a sampled call's steps compile apart from a greedy call's,
    so it chooses from its own costs (here: no tree) and keeps that; the greedy call keeps its own."""
    from transformers import LogitsProcessorList
    from transformers.generation import logits_process as lp

    from eagle_mm.decode.draft import DraftSampler

    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    kw = dict(model=model, head=head, cap=None, batch=2, mode="default", max_depth=8, max_top_k=96, shrinks=False)
    greedy = Session.start(c, gen=SimpleNamespace(do_sample=False), sampler=None, **kw)
    assert greedy.tree.drafts  # a flat verify: a tree pays
    stand_in.verify = LINEAR  # every verified token costs the first's: no tree pays
    c.entries.clear()
    sampler = DraftSampler.from_processors(LogitsProcessorList([lp.TopPLogitsWarper(0.9)]), head, None, 8)
    sampled = Session.start(c, gen=SimpleNamespace(do_sample=True, top_p=0.9), sampler=sampler, **kw)
    assert sampled.choices[0].why == "first" and not sampled.tree.drafts
    again = Session.start(c, gen=SimpleNamespace(do_sample=True, top_p=0.9), sampler=sampler, **kw)
    assert again.choices[0].why == "kept (compiled)" and again.tree == sampled.tree
    back = Session.start(c, gen=SimpleNamespace(do_sample=False), sampler=None, **kw)
    assert back.choices[0].why == "kept (compiled)" and back.tree == greedy.tree


# ---- committing a cycle's tokens ------------------------------------------------------------------
def test_block_stops_answer_as_first_stop_does():
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    g = torch.Generator().manual_seed(0)
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=30), EosTokenCriteria(eos_token_id=[3, 7])])
    lengths, blocks = [], []
    for _ in range(200):
        n, k = int(torch.randint(10, 30, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        lengths.append(n)
        blocks.append(torch.randint(0, 12, (k,), generator=g).tolist())
    stops = Stops.of(criteria)
    fast = block_stops(stops, lengths, blocks)
    for n, toks, got in zip(lengths, blocks, fast):
        seq = torch.tensor([list(range(n)) + toks])
        assert got == first_stop(stops, seq, n), (n, toks)
    eos_only = Stops.of(StoppingCriteriaList([EosTokenCriteria(eos_token_id=[3, 7])]))
    for n, toks, got in zip(lengths, blocks, block_stops(eos_only, lengths, blocks)):
        assert got == first_stop(eos_only, torch.tensor([list(range(n)) + toks]), n), (n, toks)
    user = Stops.of(StoppingCriteriaList([_Never()]))
    assert block_stops(user, [2], [[1]]) is None  # a criterion of the user's sees every prefix, row by row


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_switches_under_cuda_graphs_keep_generate_tokens(monkeypatch, batch):
    """The same scripted switches as above, each step a captured CUDA graph (the draft launched ahead of the host
    read is dropped when the tree changes), then the same call again, replaying what the first captured."""
    from eagle_mm.decode import loop

    _Scripted.script = [TreeConfig(3, 3, 8), TreeConfig.none(), TreeConfig.chain(2), TreeConfig.none(),
                        TreeConfig(4, 2, 6)]
    monkeypatch.setattr(loop, "Session", _Scripted)
    model = tiny_model("llama").cuda()
    ids = prompt(9, batch=batch, seed=5).cuda()
    head = em.EagleHead.from_target(model).cuda()
    kw = _ragged(model, ids, 30) if batch > 1 else dict(max_new_tokens=30, do_sample=False)
    ref = model.generate(ids, **kw)
    for _ in range(2):
        out = em.speculative_generate(model, head, ids, return_dict_in_generate=True, **kw)
        assert out.stats.mode == "graphs" and torch.equal(out.sequences, ref)


@needs_cuda
def test_the_probe_times_the_steps_on_cuda():
    """Timings are not asserted (only what was measured), nor left behind: the engine's own state is untouched."""
    from eagle_mm.decode.costs import probe
    from eagle_mm.decode.draft import DraftSampler
    from eagle_mm.hf.features import FeatureCapture
    from eagle_mm.hf.parts import resolve_target
    from transformers import LogitsProcessorList
    from transformers.generation import logits_process as lp

    model = tiny_model("llama").cuda()
    head = em.Eagle3Head.from_target(model).cuda()
    head.attach(model)
    parts = resolve_target(model)
    warpers = LogitsProcessorList([lp.TemperatureLogitsWarper(0.8), lp.TopPLogitsWarper(0.9)])
    with FeatureCapture(parts, head.feature_layers(parts.num_layers)) as cap, torch.no_grad():
        for sampler in (None, DraftSampler.from_processors(warpers, head, None, 8)):
            costs = probe(model, head, cap, 4, device=torch.device("cuda"), sampler=sampler, graphs=True)
            assert [q for q, _ in costs.verify][:4] == [1, 2, 4, 8] and [k for k, *_ in costs.draft] == [1, 8]
            assert all(s > 0 for _, s in costs.verify) and costs.advance > 0
    ids = prompt(9).cuda()
    out = em.speculative_generate(model, head, ids, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=16, do_sample=False))


@needs_cuda
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_repeated_default_calls_capture_nothing_new(do_sample):
    """Calls of one shape replay what the first ones captured: the chooser keeps the buffers' size and weighs a
    capture against the tokens left, so that repeating a call never captures again (it used to, call after call,
    as the capacity and the trees at each batch moved with the fitted acceptance)."""
    model = tiny_model("llama").cuda()
    ids = prompt(9, batch=4, seed=6).cuda()
    head = em.EagleHead.from_target(model).cuda()
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=do_sample)
    dec = em.decoder(model, head)
    seen = []
    for _ in range(5):
        out = em.speculative_generate(model, head, ids, return_dict_in_generate=True, **kw)
        seen.append((dec.runner.captures, dec.storage.generation, out.stats.time_compile))
    assert seen[-1][:2] == seen[-2][:2] == seen[-3][:2] and seen[-1][2] == 0.0, seen


@pytest.mark.parametrize("drafts, within, retried, batch", [(20, 1e9, True, 1), (20, 1.0, False, 1),
                                                            (4000, 1e9, False, 1), (0, 1e9, False, 1),
                                                            (20, 1e9, False, 4)])
def test_no_tree_on_thin_acceptance_drafts_the_best_tree_again(stand_in, monkeypatch, drafts, within, retried, batch):
    """A call's first choice of no tree while the acceptance rests on fewer than ``_THIN_DRAFTS`` drafts drafts the
    best tree instead, when it is expected within ``_RETRY_WITHIN`` of no tree's rate (a call without a tree observes
    no acceptance: an early low fit would stay), once; not with enough drafts seen, nor before any, nor when the tree
    is further behind, nor on a CPU above one row (every such retry seen there lost)."""
    stand_in.verify = LINEAR  # a CPU's verify: every token costs, so a poor head's trees lose
    monkeypatch.setattr(session_mod, "_RETRY_WITHIN", within)
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model)
    c = em.decoder(model, head).chooser
    start = dict(model=model, head=head, cap=None, batch=batch, gen=SimpleNamespace(do_sample=False), sampler=None,
                 mode=None, max_depth=64, max_top_k=96, shrinks=True)
    s = Session.start(c, **start)
    if drafts:
        chain = TreeConfig.chain(3)
        s.acceptance.observe(chain, drafts, [round(drafts * r) for r in position_rates(0.3, 0.3, chain, 0.3)])
    s = Session.start(c, **start)
    ranked = s.rank(batch)
    plain = next(f for f in ranked if not f.tree.drafts)
    assert ranked[0] == plain  # the fit prices every tree out
    assert s.tree.drafts == retried
    assert (s.choices[0].why == "a tree again: its acceptance is thinly measured") == retried
    if retried:  # once per batch and setting: a call that drafted it again and dropped it measured enough
        assert not Session.start(c, **start).tree.drafts
