"""Sampling-mode speculation keeps the target's distribution: statistical oracles and their controls.

Trials are batch rows: one call with B = 40k rows is 40k independent decodes. A correct rule must come
within sampling noise of the exact distribution, and the same check must reject deliberately wrong
rules, so the bounds are shown to have teeth. Seeds are fixed; the bounds come from the sample size.
"""
import pytest
import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import eagle_mm as em
from eagle_mm.decode import sampling
from eagle_mm.kernels import reference
from eagle_mm.decode.sampling import sample_children, sibling_scores, tree_rejection_sample
from eagle_mm.decode.tree import Tree, select_tree
from eagle_mm.kernels.reference import path_indices
from tests.tiny import tiny_model

B = 40_000  # trials per statistical check


def _check(freq: torch.Tensor, exact: torch.Tensor, n: int):
    """TV distance and chi-square of empirical freq vs exact (both (K,)), and their noise-only bounds.

    tv_bound: twice the TV that sampling noise alone gives on average, sum sqrt(p (1 - p) / (2 pi n)).
    chi2_bound: K - 1 + 6 sd of a chi-square with K - 1 degrees of freedom.
    """
    freq, exact = freq.double(), exact.double()
    tv = 0.5 * (freq - exact).abs().sum().item()
    keep = exact > 0
    assert bool((freq[~keep] == 0).all()), "a token of target probability 0 was emitted"
    chi2 = (n * (freq - exact)[keep] ** 2 / exact[keep]).sum().item()
    tv_bound = 2 * (exact * (1 - exact) / (2 * torch.pi * n)).sqrt().sum().item()
    dof = int(keep.sum()) - 1
    return tv, tv_bound, chi2, dof + 6 * (2 * dof) ** 0.5


def _dists(gen: torch.Generator, rows: int, V: int):
    """Target p and draft log q (rows, V): correlated, each with one random zero (q's is the top-k cut a
    processor makes; p's checks that a token the target forbids is never emitted)."""
    logits = torch.randn(rows, V, generator=gen) * 1.5
    lp = logits.clone()
    lp[torch.arange(rows), torch.randint(V, (rows,), generator=gen)] = float("-inf")
    lq = logits + torch.randn(rows, V, generator=gen)
    lq[torch.arange(rows), torch.randint(V, (rows,), generator=gen)] = float("-inf")
    return torch.softmax(lp, -1), torch.log_softmax(lq, -1)


# --- one node: k candidates -------------------------------------------------------------------------

def _one_node(p: torch.Tensor, logq: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """Emit one token per trial from a root with k sampled children. p, logq (V,) -> tokens (B,)."""
    gen = torch.Generator().manual_seed(seed)
    ids, _ = sample_children(logq.expand(B, 1, -1), k, gen)  # (B, 1, k)
    zero = torch.zeros(B, 1, dtype=torch.long)
    tree = Tree(tokens=torch.cat((zero, ids[:, 0]), 1), parent=torch.zeros(B, k + 1, dtype=torch.long),
                depth=torch.cat((zero, torch.ones(B, k, dtype=torch.long)), 1))
    # Children are leaves: their p/q rows are only used for the bonus after them, so reuse p.
    P = p.expand(B, k + 1, -1)  # (B, k+1, V)
    Q = logq.exp().expand(B, k + 1, -1)
    accept_len, best, bonus = tree_rejection_sample(tree, P, Q, gen)
    first = tree.tokens.gather(1, best[:, None]).squeeze(1)
    return torch.where(accept_len == 1, first, bonus)


@pytest.mark.parametrize("k", [1, 2, 3, 6])  # 6 = V: draws past q's support are invalid and skipped
def test_one_node_matches_target(k):
    p, logq = _dists(torch.Generator().manual_seed(k), 1, 6)
    out = _one_node(p[0], logq[0], k, seed=10 + k)
    tv, tv_bound, chi2, chi2_bound = _check(torch.bincount(out, minlength=6) / B, p[0], B)
    assert tv < min(tv_bound, 0.02) and chi2 < chi2_bound, (tv, tv_bound, chi2, chi2_bound)


# --- a depth-3 tree over a toy LM, three decode cycles ------------------------------------------------

class ToyLM:
    """p(.|path) and q(.|path) for every path up to ``max_len`` tokens over a vocab of V.

    A path's row id: root 0, child id = parent id * V + token + 1 (bijective base V), so ids are dense.
    """

    def __init__(self, V: int, max_len: int, seed: int):
        rows = sum(V ** n for n in range(max_len + 1))
        self.V = V
        self.p, self.logq = _dists(torch.Generator().manual_seed(seed), rows, V)  # (rows, V)
        self.q = self.logq.exp()

    def exact3(self) -> torch.Tensor:
        """(V**3,) exact probability of each first-3-token sequence, index t1 V^2 + t2 V + t3."""
        t = torch.arange(self.V)
        p2 = self.p[t + 1]  # (V, V) after t1
        p3 = self.p[(t[:, None] + 1) * self.V + t[None] + 1]  # (V, V, V) after t1 t2
        return (self.p[0][:, None, None] * p2[:, :, None] * p3).flatten()


def _cummin_scores(parent_score, parent_logp, logq_children):
    """A WRONG rank: parent + cummin of the children's own log q, so a child's rank reads its own value."""
    return parent_score[..., None] + torch.cummin(logq_children, dim=-1).values


def _grow(lm: ToyLM, root_id: torch.Tensor, k: int, depth: int, width: int, total: int, gen, rank):
    """Draft like ``draft.draft_tree`` in sampling mode: each level expands the ``width`` best frontier
    nodes by rank (stable sort), each draws k children; then the global rerank keeps ``total``.
    Returns the tree and each node's path id (B, N+1)."""
    n_rows, V = root_id.shape[0], lm.V
    f_id, f_score, f_logp = root_id[:, None], torch.zeros(n_rows, 1), torch.zeros(n_rows, 1)  # (B, w)
    f_idx = torch.full((n_rows, 1), -1)  # candidate index of each frontier node (-1 = root)
    toks, parents, depths, scores, n = [], [], [], [], 0
    for d in range(1, depth + 1):
        if d > 1:  # the next frontier: best ranks among the last level, ties to the earlier created
            pick = torch.sort(f_score, dim=-1, descending=True, stable=True).indices[:, :width]
            f_id, f_score, f_logp, f_idx = (t.gather(1, pick) for t in (f_id, f_score, f_logp, f_idx))
        logq = lm.logq[f_id]  # (B, w, V)
        ids, _ = sample_children(logq, k, gen)  # (B, w, k)
        lq = logq.gather(-1, ids)
        s = rank(f_score, f_logp, lq)  # (B, w, k)
        w = ids.shape[1]
        toks.append(ids.flatten(1))
        scores.append(s.flatten(1))
        parents.append(f_idx[:, :, None].expand(-1, -1, k).flatten(1))
        depths.append(torch.full((w * k,), d))
        f_idx = (n + torch.arange(w * k)).expand(n_rows, -1)
        n += w * k
        f_id, f_score = (f_id[:, :, None] * V + ids + 1).flatten(1), s.flatten(1)
        f_logp = (f_logp[:, :, None] + lq).flatten(1)
    tree = select_tree(torch.zeros(n_rows, dtype=torch.long), torch.cat(toks, 1), torch.cat(parents, 1),
                       torch.cat(depths), torch.cat(scores, 1), total)
    node_id = torch.zeros(n_rows, tree.size, dtype=torch.long)
    node_id[:, 0] = root_id
    for j in range(1, tree.size):
        node_id[:, j] = node_id.gather(1, tree.parent[:, j:j + 1]).squeeze(1) * V + tree.tokens[:, j] + 1
    return tree, node_id


def _first3(lm: ToyLM, k: int, width: int, total: int, seed: int, rank=sibling_scores, depth: int = 3):
    """Decode cycles (draft, verify, accept) until every trial has 3 tokens: (B, 3)."""
    gen = torch.Generator().manual_seed(seed)
    root_id = torch.zeros(B, dtype=torch.long)
    out = torch.zeros(B, 3, dtype=torch.long)
    n_out = torch.zeros(B, dtype=torch.long)
    for _ in range(3):  # every cycle emits at least one token
        tree, node_id = _grow(lm, root_id, k, depth, width, total, gen, rank)
        accept_len, best, bonus = tree_rejection_sample(tree, lm.p[node_id], lm.q[node_id], gen)
        path = path_indices(tree.parent, tree.depth, best, depth)  # (B, depth+1)
        new = torch.cat((tree.tokens.gather(1, path[:, 1:]), bonus[:, None]), 1)  # (B, depth+1)
        col = torch.arange(depth + 1)[None]
        new = torch.where(col == accept_len[:, None], bonus[:, None], new)  # accepted tokens, then bonus
        for c in range(3):
            src = c - n_out  # (B,) which new token lands in output column c
            ok = (src >= 0) & (src <= accept_len)
            out[:, c] = torch.where(ok, new.gather(1, src.clamp(0, depth)[:, None]).squeeze(1), out[:, c])
        n_out = n_out + accept_len + 1
        nxt = node_id.gather(1, best[:, None]).squeeze(1) * lm.V + bonus + 1
        root_id = torch.where(n_out < 3, nxt, 0)  # finished trials idle on the empty path
    return out


def _tree_check(out: torch.Tensor, lm: ToyLM):
    V = lm.V
    seq = out[:, 0] * V * V + out[:, 1] * V + out[:, 2]
    return _check(torch.bincount(seq, minlength=V ** 3) / B, lm.exact3(), B)


TREES = {"tree": dict(k=2, width=2, total=6), "chain": dict(k=1, width=1, total=3)}


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_tree_matches_target(shape):
    lm = ToyLM(V=4, max_len=5, seed=2)
    tv, tv_bound, chi2, chi2_bound = _tree_check(_first3(lm, **TREES[shape], seed=1), lm)
    assert tv < tv_bound and chi2 < chi2_bound, (tv, tv_bound, chi2, chi2_bound)


def _wrong_accept_argmax(p, q, x, u):
    return x == p.argmax(-1)  # "accept whenever the draft token is the target's argmax"


def _wrong_no_residual(p, q):
    return p  # min(1, p/q) acceptance, but a rejection leaves the target unchanged


WRONG = {"accept_argmax": ("_accept", _wrong_accept_argmax), "no_residual": ("_residual", _wrong_no_residual)}


@pytest.mark.parametrize("rule", sorted(WRONG))
def test_wrong_rule_fails_the_same_check(monkeypatch, rule):
    """The control: swapping one step of the verifier for a plausible wrong one breaks the bound."""
    name, fn = WRONG[rule]
    monkeypatch.setattr(reference, name, fn)
    lm = ToyLM(V=4, max_len=5, seed=2)
    tv, tv_bound, chi2, chi2_bound = _tree_check(_first3(lm, **TREES["tree"], seed=1), lm)
    assert tv > 2 * tv_bound and chi2 > 2 * chi2_bound, (tv, tv_bound, chi2, chi2_bound)


@pytest.mark.parametrize("rule", sorted(WRONG))
def test_wrong_rule_fails_on_one_node(monkeypatch, rule):
    name, fn = WRONG[rule]
    monkeypatch.setattr(reference, name, fn)
    p, logq = _dists(torch.Generator().manual_seed(2), 1, 6)
    out = _one_node(p[0], logq[0], 2, seed=12)
    tv, tv_bound, chi2, chi2_bound = _check(torch.bincount(out, minlength=6) / B, p[0], B)
    assert tv > 2 * tv_bound and chi2 > 2 * chi2_bound, (tv, tv_bound, chi2, chi2_bound)


def test_rank_reading_the_childs_own_probability_is_biased():
    """Why ``sibling_scores`` does not look at the child it ranks: with parent + cummin(log q) the rerank
    keeps a sampled child more often when its q is high, and the verifier then over-emits it, even though
    every node's kept children are still a prefix of its draws and the acceptance rule is right."""
    lm = ToyLM(V=4, max_len=5, seed=2)
    tv, tv_bound, chi2, chi2_bound = _tree_check(_first3(lm, **TREES["tree"], seed=1, rank=_cummin_scores), lm)
    assert tv > tv_bound and chi2 > 2 * chi2_bound, (tv, tv_bound, chi2, chi2_bound)


# --- the pieces ---------------------------------------------------------------------------------------

def test_sample_children_draws_without_replacement():
    V, k = 6, 3
    _, logq = _dists(torch.Generator().manual_seed(3), 1, V)
    q = logq[0].exp()
    ids, valid = sample_children(logq[0].expand(B, 1, V), k, torch.Generator().manual_seed(4))  # (B, 1, k)
    ids, valid = ids[:, 0], valid[:, 0]
    assert bool((ids[:, :, None] != ids[:, None, :]).logical_or(torch.eye(k, dtype=torch.bool)).all())
    assert torch.equal(valid, q[ids] > 0)
    # The law of the first two draws: P(a, b) = q(a) q(b) / (1 - q(a)).
    exact = (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0).flatten()
    tv, tv_bound, chi2, chi2_bound = _check(torch.bincount(ids[:, 0] * V + ids[:, 1], minlength=V * V) / B, exact, B)
    assert tv < tv_bound and chi2 < chi2_bound, (tv, tv_bound, chi2, chi2_bound)
    # Tokens with q = 0 are drawn only once the support is used up: all of them, last, and invalid.
    _, dense = sample_children(logq[0].expand(8, 1, V), V)
    assert torch.equal(dense[:, 0], (torch.arange(V) < int((q > 0).sum())).expand(8, -1))
    with pytest.raises(ValueError, match="k=7"):
        sample_children(logq, V + 1)


def test_sibling_scores_rank_a_prefix_without_reading_the_child():
    gen = torch.Generator().manual_seed(5)
    _, logq = _dists(gen, 12, 5)
    ids, _ = sample_children(logq.view(3, 4, 5), 5, gen)
    lq = logq.view(3, 4, 5).gather(-1, ids)  # (3, 4, 5) in draw order, -inf last
    parent_logp = -torch.rand(3, 4, generator=gen) * 3
    parent_score = parent_logp + torch.rand(3, 4, generator=gen)  # a parent's rank >= its own log-prob
    s = sibling_scores(parent_score, parent_logp, lq)
    assert bool((s[..., 1:] <= s[..., :-1]).all()) and bool((s <= parent_score[..., None]).all())
    assert torch.equal(s[..., 0], parent_logp)  # nothing drawn yet: the parent's path probability
    assert bool((s[lq == float("-inf")] == float("-inf")).all())
    # Changing a valid child's own log q leaves its rank (and earlier ones) as they were.
    for i in range(4):
        changed = lq.clone()
        changed[..., i] = torch.where(lq[..., i] > float("-inf"), lq[..., i] - 1.0, lq[..., i])
        assert torch.equal(sibling_scores(parent_score, parent_logp, changed)[..., : i + 1], s[..., : i + 1])


def test_perfect_draft_accepts_every_first_child():
    lm = ToyLM(V=4, max_len=3, seed=6)
    lm.q = lm.p  # q = p exactly, so every ratio p/q is 1
    lm.logq = lm.p.log()
    gen = torch.Generator().manual_seed(7)
    tree, node_id = _grow(lm, torch.zeros(256, dtype=torch.long), 2, 3, 2, 6, gen, sibling_scores)
    accept_len, best, _ = tree_rejection_sample(tree, lm.p[node_id], lm.q[node_id], gen)
    # Follow first children from the root: the first node (index order) whose parent is the current one.
    cur = torch.zeros(256, dtype=torch.long)
    for j in range(1, tree.size):
        cur = torch.where(tree.parent[:, j] == cur, j, cur)
    assert torch.equal(best, cur) and torch.equal(accept_len, tree.depth.gather(1, cur[:, None]).squeeze(1))
    assert bool((accept_len >= 1).all())


def test_same_seed_same_outputs():
    lm = ToyLM(V=4, max_len=3, seed=8)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        tree, node_id = _grow(lm, torch.zeros(64, dtype=torch.long), 2, 3, 2, 6, gen, sibling_scores)
        return (tree.tokens, *tree_rejection_sample(tree, lm.p[node_id], lm.q[node_id], gen))

    first, again, other = run(9), run(9), run(10)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_shape_errors_name_the_shapes():
    tree = Tree(tokens=torch.zeros(2, 3, dtype=torch.long), parent=torch.zeros(2, 3, dtype=torch.long),
                depth=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(2, 3, V\)"):
        tree_rejection_sample(tree, torch.rand(2, 4, 5), torch.rand(2, 4, 5))


def _sampler(warpers, vocab=50, min_width=1):
    from transformers import LogitsProcessorList

    from eagle_mm.decode.draft import DraftSampler

    head = em.Eagle3Head.from_target(tiny_model("llama", vocab_size=vocab))
    return DraftSampler.from_processors(LogitsProcessorList(warpers), head, None, min_width)


def _dense(sampler, logits):
    cand, logq = sampler.proposal(logits)
    return torch.zeros(*logits.shape[:-1], sampler.vocab_size).scatter_(-1, cand, logq.exp())


@pytest.mark.parametrize("warpers", [
    [TemperatureLogitsWarper(0.7), TopKLogitsWarper(9), TopPLogitsWarper(0.8)],
    [TopPLogitsWarper(0.9, min_tokens_to_keep=3)],
    [TemperatureLogitsWarper(1.3), MinPLogitsWarper(0.1)],
], ids=["temp-topk-topp", "topp-keep3", "temp-minp"])
def test_compact_proposal_is_the_warped_draft(warpers):
    """With the generate() warpers the proposal lives on the draft's top-W tokens; when W covers the vocabulary it
    is the distribution transformers' warpers give the draft logits."""
    from eagle_mm.decode import draft

    s = _sampler(warpers, vocab=40)
    assert s.compact and s.width == min(40, min([p.top_k for p in warpers if hasattr(p, "top_k")],
                                               default=draft.DRAFT_WIDTH))
    s.width = 40  # the whole vocabulary: nothing cut but what the warpers cut
    logits = torch.randn(3, 2, 40, generator=torch.Generator().manual_seed(0)) * 3
    want = torch.softmax(s.warpers(torch.zeros(6, 1, dtype=torch.long), logits.view(6, 40)), -1).view(3, 2, 40)
    torch.testing.assert_close(_dense(s, logits), want, atol=1e-6, rtol=1e-5)


def test_compact_proposal_keeps_width_tokens_and_other_warpers_use_the_vocabulary():
    from transformers import TypicalLogitsWarper

    s = _sampler([TopKLogitsWarper(5)], vocab=50, min_width=8)  # the tree draws 8 children: W = 8, q on 5
    cand, logq = s.proposal(torch.randn(2, 1, 50))
    assert cand.shape == (2, 1, 8) and (logq[..., :5] > float("-inf")).all() and (logq[..., 5:] == float("-inf")).all()
    assert (cand.sort(-1).values.diff(dim=-1) > 0).all()  # distinct tokens
    full = _sampler([TypicalLogitsWarper(0.9)], vocab=50)
    assert not full.compact and full.width == 50
    assert full.proposal(torch.randn(2, 1, 50))[0].shape == (2, 1, 50)


def test_exp_noise_is_exponential():
    """The CPU's Exp(1) draws (-log(1 - U)): finite, non-negative, seeded, and Exp(1) by a Kolmogorov-Smirnov bound
    (1.63 / sqrt(n): a 1% level), which a wrong transform (U itself, or Exp(2)) fails."""
    n = 200_000
    e = sampling.exp_noise(torch.empty(n), torch.Generator().manual_seed(0))
    again = sampling.exp_noise(torch.empty(n), torch.Generator().manual_seed(0))
    assert torch.equal(e, again) and bool(torch.isfinite(e).all()) and float(e.min()) >= 0

    def ks(x: torch.Tensor, rate: float = 1.0) -> float:
        x = x.double().sort().values
        cdf = 1 - torch.exp(-rate * x)
        i = torch.arange(1, n + 1, dtype=torch.float64)
        return float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())

    bound = 1.63 / n ** 0.5
    assert ks(e) < bound
    assert ks(torch.rand(n, generator=torch.Generator().manual_seed(1))) > bound  # U(0, 1) is not Exp(1)
    assert ks(e / 2) > bound  # Exp(2) is not Exp(1)
