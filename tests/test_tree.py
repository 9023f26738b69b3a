"""The pure tree functions (no model), TreeConfig validation, and draft_tree against a step-by-step oracle."""
from __future__ import annotations

import itertools
import re

import pytest
import torch

import eagle_mm as em
from eagle_mm.decode.draft import draft_tree, head_cache
from eagle_mm.decode.tree import Tree, ancestors, select_tree
from eagle_mm.kernels.reference import greedy_accept, path_indices
from tests.tiny import tiny_model

# A hand-built tree, root at 0:      0
#                                  /   \
#                                 1     2
#                                / \     \
#                               3   4     5
#                               |
#                               6
PARENT = torch.tensor([0, 0, 0, 1, 1, 2, 3])
DEPTH = torch.tensor([0, 1, 1, 2, 2, 2, 3])
TOKENS = torch.tensor([50, 10, 11, 20, 21, 22, 30])  # siblings carry distinct tokens


def _tree(batch: int = 1) -> Tree:
    return Tree(tokens=TOKENS.expand(batch, -1).clone(), parent=PARENT.expand(batch, -1).clone(),
                depth=DEPTH.expand(batch, -1).clone())


def _random_candidates(batch: int, width: int, levels: int, seed: int):
    """Candidates grown like draft_tree: ``width`` at depth 1, then ``width`` children for each of ``width``
    frontier nodes per level; cumulative scores = parent's + a negative log-prob (ties have probability 0)."""
    g = torch.Generator().manual_seed(seed)
    toks, pars, deps, scores = [], [], [], []
    for _ in range(batch):
        tok, par, dep, sc = [], [], [], []
        front = []
        for i in range(width):
            tok.append(int(torch.randint(0, 1000, (), generator=g)))
            par.append(-1)
            dep.append(1)
            sc.append(-float(torch.rand((), generator=g)) * 3)
            front.append(i)
        for d in range(2, levels + 1):
            new = []
            for p in front:
                for _ in range(width):
                    new.append(len(tok))
                    tok.append(int(torch.randint(0, 1000, (), generator=g)))
                    par.append(p)
                    dep.append(d)
                    sc.append(sc[p] - float(torch.rand((), generator=g)) * 3)
            front = sorted(new, key=lambda i: -sc[i])[:width]
        toks.append(tok)
        pars.append(par)
        deps.append(dep)
        scores.append(sc)
    return (torch.tensor(toks), torch.tensor(pars), torch.tensor(deps), torch.tensor(scores, dtype=torch.float64))


def _check_connected(tree: Tree) -> None:
    B, n = tree.tokens.shape
    assert torch.equal(tree.parent[:, 0], torch.zeros(B, dtype=torch.long))
    assert torch.equal(tree.depth[:, 0], torch.zeros(B, dtype=torch.long))
    idx = torch.arange(n)
    assert bool((tree.parent[:, 1:] < idx[1:]).all()), tree.parent
    assert bool((tree.parent[:, 1:] >= 0).all()), tree.parent
    assert torch.equal(tree.depth[:, 1:], tree.depth.gather(1, tree.parent)[:, 1:] + 1), (tree.parent, tree.depth)


# ---- select_tree -----------------------------------------------------------------------------------
@pytest.mark.compat
@pytest.mark.parametrize("total", [1, 4, 9, 20, 21])
def test_select_tree_keeps_the_best_total_and_stays_connected(total):
    width, levels, B = 3, 3, 4
    tok, par, dep, sc = _random_candidates(B, width, levels, seed=total)
    root = torch.tensor([7, 8, 9, 10])
    tree = select_tree(root, tok, par, dep, sc, total)
    assert tree.tokens.shape == (B, total + 1)
    assert torch.equal(tree.tokens[:, 0], root)
    _check_connected(tree)
    for b in range(B):
        best = sorted(range(tok.shape[1]), key=lambda i: -float(sc[b, i]))[:total]
        keep = sorted(best)  # kept nodes stay in creation order
        assert tree.tokens[b, 1:].tolist() == tok[b, keep].tolist()
        assert tree.depth[b, 1:].tolist() == dep[b, keep].tolist()
        # Each kept node's parent is the kept node made from its candidate parent (or the root).
        new_of = {c: i + 1 for i, c in enumerate(keep)}
        want_parent = [0 if int(par[b, c]) < 0 else new_of[int(par[b, c])] for c in keep]
        assert tree.parent[b, 1:].tolist() == want_parent


def test_select_tree_batch_rows_are_independent():
    tok, par, dep, sc = _random_candidates(3, 2, 3, seed=11)
    root = torch.tensor([1, 2, 3])
    both = select_tree(root, tok, par, dep, sc, 6)
    for b in range(3):
        one = select_tree(root[b: b + 1], tok[b: b + 1], par[b: b + 1], dep[b: b + 1], sc[b: b + 1], 6)
        for field in ("tokens", "parent", "depth"):
            assert torch.equal(getattr(both, field)[b], getattr(one, field)[0]), (b, field)
    # The rows really differ, so the comparison above means something.
    assert not torch.equal(both.tokens[0], both.tokens[1])


def test_select_tree_tie_between_parent_and_child_keeps_the_parent():
    # c0 (depth 1, -1.0), c1 (depth 1, -2.0), c2 child of c0 with log-prob 0: the same score as c0.
    tok = torch.tensor([[10, 11, 12]])
    par = torch.tensor([[-1, -1, 0]])
    dep = torch.tensor([1, 1, 2])
    sc = torch.tensor([[-1.0, -2.0, -1.0]])
    one = select_tree(torch.tensor([5]), tok, par, dep, sc, 1)
    assert one.tokens.tolist() == [[5, 10]]
    two = select_tree(torch.tensor([5]), tok, par, dep, sc, 2)
    assert two.tokens.tolist() == [[5, 10, 12]] and two.parent.tolist() == [[0, 0, 1]]
    # The child created before an equally scored unrelated node still comes after its parent.
    sc = torch.tensor([[-1.0, -1.0, -1.0]])
    two = select_tree(torch.tensor([5]), tok, par, dep, sc, 2)
    assert two.tokens.tolist() == [[5, 10, 11]]
    _check_connected(two)


def test_select_tree_chain():
    # top_k=1: one candidate per level, each the child of the previous one.
    tok = torch.tensor([[4, 5, 6, 7], [8, 9, 10, 11]])
    par = torch.tensor([[-1, 0, 1, 2]] * 2)
    dep = torch.tensor([1, 2, 3, 4])
    sc = torch.tensor([[-0.1, -0.5, -0.6, -2.0], [-1.0, -1.0, -3.0, -3.5]])
    tree = select_tree(torch.tensor([1, 2]), tok, par, dep, sc, 4)
    assert tree.tokens.tolist() == [[1, 4, 5, 6, 7], [2, 8, 9, 10, 11]]
    assert tree.parent.tolist() == [[0, 0, 1, 2, 3]] * 2
    assert tree.depth.tolist() == [[0, 1, 2, 3, 4]] * 2


def test_select_tree_rejects_bad_total():
    tok, par, dep = torch.tensor([[1, 2]]), torch.tensor([[-1, 0]]), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="total=3"):
        select_tree(torch.tensor([0]), tok, par, dep, torch.tensor([[-1.0, -2.0]]), 3)
    with pytest.raises(ValueError, match="total=0"):
        select_tree(torch.tensor([0]), tok, par, dep, torch.tensor([[-1.0, -2.0]]), 0)
    # Scores that increase with depth break the caller's contract; select_tree does not check it on the
    # hot path (it would cost a host sync), the draft's scores guarantee it.


# ---- ancestors -------------------------------------------------------------------------------------
def test_ancestors_exact_matrix():
    want = torch.tensor([
        # 0  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],  # 0
        [1, 1, 0, 0, 0, 0, 0],  # 1
        [1, 0, 1, 0, 0, 0, 0],  # 2
        [1, 1, 0, 1, 0, 0, 0],  # 3
        [1, 1, 0, 0, 1, 0, 0],  # 4
        [1, 0, 1, 0, 0, 1, 0],  # 5
        [1, 1, 0, 1, 0, 0, 1],  # 6
    ], dtype=torch.bool)
    anc = ancestors(PARENT[None], max_depth=3)
    assert anc.dtype == torch.bool and anc.shape == (1, 7, 7)
    assert torch.equal(anc[0], want)
    # Deeper max_depth changes nothing once the tree's depth is covered.
    assert torch.equal(ancestors(PARENT[None], max_depth=6)[0], want)


def test_ancestors_batch_rows_differ():
    chain = torch.tensor([0, 0, 1, 2])
    star = torch.tensor([0, 0, 0, 0])
    anc = ancestors(torch.stack((chain, star)), max_depth=3)
    assert torch.equal(anc[0], torch.ones(4, 4, dtype=torch.bool).tril())
    want_star = torch.eye(4, dtype=torch.bool)
    want_star[:, 0] = True
    assert torch.equal(anc[1], want_star)


# ---- greedy_accept ---------------------------------------------------------------------------------
def _nodes(tree: Tree):
    return tree.tokens, tree.parent, tree.depth


def _target_after(choices: dict[int, int], fill: int = 99) -> torch.Tensor:
    """The target's greedy token after each node: ``choices[node]``, else a token no node carries."""
    t = torch.full((7,), fill)
    for node, tok in choices.items():
        t[node] = tok
    return t


def test_greedy_accept_nothing():
    acc, best = greedy_accept(*_nodes(_tree()), _target_after({})[None], max_depth=3)
    assert acc.tolist() == [0] and best.tolist() == [0]


def test_greedy_accept_full_path():
    target = _target_after({0: 10, 1: 20, 3: 30})
    acc, best = greedy_accept(*_nodes(_tree()), target[None], max_depth=3)
    assert acc.tolist() == [3] and best.tolist() == [6]


def test_greedy_accept_branch_when_sibling_rejected():
    # Root -> 2 (token 11) accepted, its sibling 1 not; then 5 (22).
    target = _target_after({0: 11, 2: 22, 1: 20, 3: 30})
    acc, best = greedy_accept(*_nodes(_tree()), target[None], max_depth=3)
    assert acc.tolist() == [2] and best.tolist() == [5]
    # Root -> 1 accepted, then the second child 4 (21) rather than the first child 3.
    target = _target_after({0: 10, 1: 21, 3: 30})
    acc, best = greedy_accept(*_nodes(_tree()), target[None], max_depth=3)
    assert acc.tolist() == [2] and best.tolist() == [4]


def test_greedy_accept_needs_the_whole_ancestry():
    # Node 6 matches its parent's choice, but its parent 3 does not match node 1's choice.
    target = _target_after({0: 10, 1: 21, 3: 30})
    acc, best = greedy_accept(*_nodes(_tree()), target[None], max_depth=3)
    assert best.tolist() == [4]
    # Node 3 matches node 1's choice, but node 1 is not the root's choice: nothing.
    target = _target_after({0: 77, 1: 20, 3: 30})
    acc, best = greedy_accept(*_nodes(_tree()), target[None], max_depth=3)
    assert acc.tolist() == [0] and best.tolist() == [0]


def test_greedy_accept_rows_differ():
    target = torch.stack((_target_after({0: 10, 1: 20, 3: 30}), _target_after({}),
                          _target_after({0: 11, 2: 22}), _target_after({0: 10, 1: 21})))
    acc, best = greedy_accept(*_nodes(_tree(4)), target, max_depth=3)
    assert acc.tolist() == [3, 0, 2, 2]
    assert best.tolist() == [6, 0, 5, 4]


def test_greedy_accept_matches_brute_force_on_random_trees():
    tok, par, dep, sc = _random_candidates(6, 3, 4, seed=5)
    tree = select_tree(torch.zeros(6, dtype=torch.long), tok % 4, par, dep, sc, 16)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        target = torch.randint(0, 4, tree.tokens.shape, generator=g)
        acc, best = greedy_accept(*_nodes(tree), target, max_depth=4)
        for b in range(6):
            ok = {0}
            for i in range(1, tree.size):  # parents come first
                p = int(tree.parent[b, i])
                if p in ok and int(tree.tokens[b, i]) == int(target[b, p]):
                    ok.add(i)
            deepest = max(int(tree.depth[b, i]) for i in ok)
            assert int(acc[b]) == deepest
            assert int(best[b]) in ok and int(tree.depth[b, best[b]]) == deepest


# ---- path_indices ----------------------------------------------------------------------------------
@pytest.mark.parametrize("best,want", [(6, [0, 1, 3, 6, 6, 6]), (4, [0, 1, 4, 4, 4, 4]), (5, [0, 2, 5, 5, 5, 5]),
                                       (2, [0, 2, 2, 2, 2, 2]), (0, [0, 0, 0, 0, 0, 0])])
def test_path_indices_root_to_best_then_repeats_best(best, want):
    path = path_indices(*_nodes(_tree())[1:], torch.tensor([best]), max_depth=5)
    assert path.tolist() == [want]


def test_path_indices_rows_differ_and_exact_depth():
    path = path_indices(*_nodes(_tree(3))[1:], torch.tensor([6, 5, 0]), max_depth=3)
    assert path.tolist() == [[0, 1, 3, 6], [0, 2, 5, 5], [0, 0, 0, 0]]


# ---- TreeConfig ------------------------------------------------------------------------------------
@pytest.mark.compat
@pytest.mark.parametrize("field,value", [("depth", -3), ("top_k", 0), ("total_tokens", 0),
                                         ("top_k", 2.5), ("depth", True), ("total_tokens", "8")])
def test_tree_config_rejects_bad_values(field, value):
    kw = dict(depth=3, top_k=2, total_tokens=4)
    kw[field] = value
    with pytest.raises(ValueError, match=re.escape(f"{field} must be a positive int, got {value!r}")):
        em.TreeConfig(**kw)


def test_depth_0_is_no_tree_only():
    """Depth 0 drafts nothing (``TreeConfig.none()``): other fields than top_k=1, total_tokens=0 are refused."""
    none = em.TreeConfig.none()
    assert (none.depth, none.top_k, none.total_tokens, none.drafts) == (0, 1, 0, False)
    assert em.TreeConfig(depth=0, top_k=1, total_tokens=0) == none
    with pytest.raises(ValueError, match=r"depth 0 drafts nothing: it takes top_k=1, total_tokens=0 .*got top_k=2"):
        em.TreeConfig(depth=0, top_k=2, total_tokens=4)


def test_tree_config_chain_and_capacity():
    c = em.TreeConfig.chain(5)
    assert (c.depth, c.top_k, c.total_tokens) == (5, 1, 5)
    with pytest.raises(ValueError, match="total_tokens=4"):
        em.TreeConfig(depth=5, top_k=1, total_tokens=4)
    # depth 3, top_k 2 drafts 2 + 2 * 2 * 2 = 10 candidates.
    assert em.TreeConfig(depth=3, top_k=2, total_tokens=10).total_tokens == 10
    with pytest.raises(ValueError, match="total_tokens=11"):
        em.TreeConfig(depth=3, top_k=2, total_tokens=11)
    with pytest.raises(ValueError, match="total_tokens=4"):
        em.TreeConfig(depth=1, top_k=3, total_tokens=4)


def test_tree_config_is_frozen():
    with pytest.raises(AttributeError):
        em.TreeConfig().depth = 3


# ---- draft_tree with a real (random) head ----------------------------------------------------------
@pytest.fixture(scope="module")
def head():
    torch.manual_seed(0)
    h = em.Eagle3Head.from_target(tiny_model("llama"))
    # Random init gives near-uniform draft logits; sharpen them so top-k choices are far from ties.
    with torch.no_grad():
        h.lm_head.weight.mul_(8.0)
    return h


def _feats(B: int, A: int, F: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, A, F, generator=torch.Generator().manual_seed(seed))


def _toks(B: int, A: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (B, A), generator=torch.Generator().manual_seed(seed))


def _draft(head, cache, root, root_out, root_logits, root_pos, cfg) -> Tree:
    """Greedy draft_tree (no sampler); newer versions also return the proposal q, None when greedy."""
    with torch.no_grad():
        out = draft_tree(head, cache, root, root_out, root_logits, root_pos, cfg)
    return out[0] if isinstance(out, tuple) else out


def _prefilled(head, feats, toks, pos):
    """Head cache over a prompt, and the root's entry: like speculative_generate's prefill."""
    with torch.no_grad():
        cache, out, logits = head_cache(head, feats, toks, pos)
    return cache, toks[:, -1], out[:, -1], logits[:, -1], pos[:, -1] + 1


def _run_path(head, cache, root_out, root_pos, path):
    """Oracle: run the head along ``path`` (its draft tokens, depth 1..d) one entry at a time, for one row.

    Returns the log-probs the head gives the next token after each path node: (d, V_draft).
    """
    valid = cache.pos[0] >= 0
    k, v = cache.k[:, :, valid], cache.v[:, :, valid]
    h, out = root_out[None, None], []
    with torch.no_grad():
        for j, t in enumerate(path):
            mask = torch.zeros(1, 1, 1, k.shape[2] + 1)  # all past entries visible, no padding left
            o, logits, (k1, v1) = head.step(head.embed(torch.tensor([[t]])), h, (root_pos + j).view(1, 1), mask, (k, v))
            k, v, h = torch.cat((k, k1), 2), torch.cat((v, v1), 2), o
            out.append(torch.log_softmax(logits[0, 0].float(), -1))
    return torch.stack(out)


def _paths(tree: Tree, b: int) -> list[tuple[int, ...]]:
    paths = [()]
    for i in range(1, tree.size):
        paths.append(paths[int(tree.parent[b, i])] + (int(tree.tokens[b, i]),))
    return paths


@pytest.mark.compat
def test_draft_tree_chain_is_the_heads_greedy_chain(head):
    F = 3 * head.config.target_hidden_size
    feats, toks = _feats(1, 9, F), _toks(1, 9)
    cache, root, root_out, root_logits, root_pos = _prefilled(head, feats, toks, torch.arange(9)[None])
    depth = 5
    tree = _draft(head, cache, root, root_out, root_logits, root_pos, em.TreeConfig.chain(depth))
    assert tree.size == depth + 1
    assert tree.parent.tolist() == [[0] + list(range(depth))]
    assert tree.depth.tolist() == [list(range(depth + 1))]
    assert int(tree.tokens[0, 0]) == int(root[0])
    chain = [int(root_logits[0].argmax())]
    for _ in range(depth - 1):
        chain.append(int(_run_path(head, cache, root_out[0], root_pos[0], chain)[-1].argmax()))
    assert tree.tokens[0, 1:].tolist() == chain
    # The head's cache is not modified by drafting.
    assert cache.k.shape[2] == 9


@pytest.mark.parametrize("cfg", [em.TreeConfig.chain(4), em.TreeConfig(depth=4, top_k=3, total_tokens=12)])
def test_draft_tree_rows_with_left_padding_match_unpadded_rows(head, cfg):
    """Row 1 is left-padded by 3; each row's tree equals the one drafted for it alone."""
    F = 3 * head.config.target_hidden_size
    feats, toks = _feats(2, 8, F, seed=3), _toks(2, 8, seed=4)
    pos = torch.stack((torch.arange(8), torch.arange(-3, 5).clamp(min=-1)))  # row 1: -1 -1 -1 0 1 2 3 4
    cache, root, root_out, root_logits, root_pos = _prefilled(head, feats, toks, pos)
    both = _draft(head, cache, root, root_out, root_logits, root_pos, cfg)
    for b, start in ((0, 0), (1, 3)):
        alone = _prefilled(head, feats[b: b + 1, start:], toks[b: b + 1, start:], pos[b: b + 1, start:])
        one = _draft(head, *alone, cfg)
        assert both.tokens[b].tolist() == one.tokens[0].tolist(), b
        assert both.parent[b].tolist() == one.parent[0].tolist(), b
    assert both.tokens[0, 1:].tolist() != both.tokens[1, 1:].tolist()


@pytest.mark.parametrize("cfg", [em.TreeConfig(depth=3, top_k=2, total_tokens=5),
                                 em.TreeConfig(depth=3, top_k=2, total_tokens=10),
                                 em.TreeConfig(depth=4, top_k=3, total_tokens=12),
                                 em.TreeConfig(depth=1, top_k=4, total_tokens=3)])
def test_draft_tree_matches_a_path_by_path_oracle(head, cfg):
    """Every node's path and the kept set equal an EAGLE-2 tree grown by rerunning the head on each path."""
    F = 3 * head.config.target_hidden_size
    feats, toks = _feats(1, 6, F, seed=7), _toks(1, 6, seed=8)
    cache, root, root_out, root_logits, root_pos = _prefilled(head, feats, toks, torch.arange(6)[None])
    tree = _draft(head, cache, root, root_out, root_logits, root_pos, cfg)
    assert tree.size == cfg.total_tokens + 1
    _check_connected(tree)
    assert bool((tree.depth[:, 1:] >= 1).all()) and bool((tree.depth <= cfg.depth).all())
    k = cfg.top_k
    # Oracle: candidates as (path, cumulative log-prob); frontier = the k best of each level.
    logp0 = torch.log_softmax(root_logits[0].float(), -1)
    s, ids = logp0.topk(k)
    level = [((int(t),), float(x)) for t, x in zip(ids, s)]
    rank = {p: r for r, (p, _) in enumerate(level)}  # a path's last node's place among its siblings, by the head
    depth1 = {p[0] for p, _ in level}
    cands = list(level)
    for _ in range(cfg.depth - 1):
        children = []
        for path, score in level:
            lp = _run_path(head, cache, root_out[0], root_pos[0], list(path))[-1]
            cs, ci = lp.topk(k)
            children += [(path + (int(t),), score + float(x)) for t, x in zip(ci, cs)]
            rank.update({path + (int(t),): r for r, t in enumerate(ci)})
        cands += children
        level = sorted(children, key=lambda c: -c[1])[:k]
    want = {p for p, _ in sorted(cands, key=lambda c: -c[1])[: cfg.total_tokens]}
    got = _paths(tree, 0)[1:]
    assert len(set(got)) == len(got)
    assert set(got) == want
    # The rank the engine records (the acceptance's fit reads the first choices by it): candidate index mod top_k.
    assert [int(i) % k for i in tree.source[0, 1:]] == [rank[p] for p in got]
    assert {int(t) for t, d in zip(tree.tokens[0], tree.depth[0]) if int(d) == 1} <= depth1


def test_draft_tree_full_capacity(head):
    """total_tokens at TreeConfig's upper bound: draft_tree has exactly that many candidates."""
    cfg = em.TreeConfig(depth=3, top_k=3, total_tokens=3 + 2 * 9)
    F = 3 * head.config.target_hidden_size
    cache, root, root_out, root_logits, root_pos = _prefilled(head, _feats(2, 5, F), _toks(2, 5),
                                                              torch.arange(5).expand(2, -1))
    tree = _draft(head, cache, root, root_out, root_logits, root_pos, cfg)
    assert tree.tokens.shape == (2, cfg.total_tokens + 1)
    _check_connected(tree)
    for b in range(2):
        assert (tree.depth[b] == 1).sum() == 3 and (tree.depth[b] == 2).sum() == 9 and (tree.depth[b] == 3).sum() == 9
        assert sorted(tree.tokens[b][tree.depth[b] == 1].tolist()) == sorted(root_logits[b].topk(3).indices.tolist())
        assert len(set(_paths(tree, b))) == tree.size


def test_ancestors_of_a_drafted_tree_follow_its_parents(head):
    F = 3 * head.config.target_hidden_size
    cache, *rest = _prefilled(head, _feats(1, 5, F), _toks(1, 5), torch.arange(5)[None])
    cfg = em.TreeConfig(depth=4, top_k=2, total_tokens=9)
    tree = _draft(head, cache, *rest, cfg)
    anc = ancestors(tree.parent, cfg.depth)[0]
    for i, j in itertools.product(range(tree.size), repeat=2):
        node, up = i, {i}
        while node:
            node = int(tree.parent[0, node])
            up.add(node)
        assert bool(anc[i, j]) == (j in up), (i, j)
