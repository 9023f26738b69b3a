"""Triton sampling verification (the recursive rejection walk) vs the torch reference and vs the target.

On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py and below).
With TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernel on the GPU, and so do the
CUDA-only ones (a real vocabulary, many trials). The interpreter pays ~2 ms per Triton function call, so
the shapes here are small and the CPU statistical checks use a few hundred trials, not tens of thousands.

Equality is exact on (accept_len, best, bonus) given the same noise. The kernel's floats may differ from
the reference's in the last bit (see eagle_mm/kernels/triton_sampling.py), which flips a decision with
probability ~1e-7: the fixed seeds below hit none.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernel module

import pytest  # noqa: E402
import torch  # noqa: E402

from eagle_mm.kernels import verify_sampling  # noqa: E402
from eagle_mm.kernels.dispatch import ENV_BACKEND  # noqa: E402
from eagle_mm.decode.sampling import (rejection_walk, sample_children, tree_rejection_sample,  # noqa: E402
                               tree_rejection_sample_scores)
from eagle_mm.decode.tree import Tree  # noqa: E402
from test_sampling import _check  # noqa: E402

triton = pytest.importorskip("triton")
tl = triton.language  # visible to the Triton function defined here (the interpreter looks for it)
from eagle_mm.kernels import triton_sampling  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(not INTERPRET and DEVICE == "cpu",
                                  reason="no CUDA device and TRITON_INTERPRET is not 1")
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU and TRITON_INTERPRET=0")
FIELDS = ("accept_len", "best", "bonus")


def _parents(B: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random valid trees (B, n): parent[i] < i, near i half the time so trees get deep."""
    parent = torch.zeros(B, n, dtype=torch.long)
    for b in range(B):
        for i in range(1, n):
            lo = max(0, i - 3) if torch.rand(1, generator=gen).item() < 0.5 else 0
            parent[b, i] = torch.randint(lo, i, (1,), generator=gen).item()
    return parent


def _row(kind: str, n: int, V: int, gen: torch.Generator):
    """One row's scores and q (n, V) of a kind:
    mixed: correlated p and q, ~30% of p's tokens masked (-inf) and ~30% of q's zero;
    equal: q = softmax(scores), so every candidate is accepted;
    disjoint: p lives on even tokens, q on odd ones, so every candidate is rejected (residual path);
    sparse_q: q has two tokens per node, so siblings use its support up (q(x) == 0: skipped)."""
    scores = torch.randn(n, V, generator=gen) * 2
    logq = scores + torch.randn(n, V, generator=gen)
    odd = torch.arange(V) % 2 == 1
    if kind == "disjoint":
        scores, logq = scores.masked_fill(odd, float("-inf")), logq.masked_fill(~odd, float("-inf"))
    else:
        scores = scores.masked_fill(torch.rand(n, V, generator=gen) < 0.3, float("-inf"))
    if kind == "mixed":
        logq = logq.masked_fill(torch.rand(n, V, generator=gen) < 0.3, float("-inf"))
    if kind == "sparse_q":
        keep = torch.rand(n, V, generator=gen).argsort(-1) < 2
        logq = logq.masked_fill(~keep, float("-inf"))
    # At least one finite score and one draft token per node (else softmax / q are NaN, not a tree).
    rows, live = torch.arange(n), torch.randint(0, V, (n,), generator=gen)
    if kind == "disjoint":
        live -= live % 2
    scores[rows, live] = scores[rows, live].nan_to_num(neginf=0.0)
    if (logq == float("-inf")).all(-1).any():  # never for disjoint rows: V > 1 has odd tokens
        logq[rows, (live + 1) % V] = 0.0
    return scores, torch.softmax(scores, -1) if kind == "equal" else torch.softmax(logq, -1)


def _tokens(parent: torch.Tensor, q: torch.Tensor, random_share: float, gen: torch.Generator) -> torch.Tensor:
    """Each node's token drawn from its parent's q without its earlier siblings (as sample_children
    does); ``random_share`` of them (and any drawn after q's support ran out) uniform instead."""
    n, V = q.shape
    tokens = torch.zeros(n, dtype=torch.long)
    for j in range(1, n):
        par = parent[j].item()
        avail = q[par].clone()
        avail[tokens[1:j][parent[1:j] == par]] = 0
        if avail.sum() > 0 and torch.rand(1, generator=gen).item() >= random_share:
            tokens[j] = torch.multinomial(avail, 1, generator=gen).item()
        else:
            tokens[j] = torch.randint(0, V, (1,), generator=gen).item()
    return tokens


def make_case(B: int, n: int, V: int, kinds, seed: int):
    """(tokens, parent, scores, q, u, e) on DEVICE; row b of kind kinds[b % len(kinds)]."""
    gen = torch.Generator().manual_seed(seed)
    parent = _parents(B, n, gen)
    rows = [_row(kinds[b % len(kinds)], n, V, gen) for b in range(B)]
    scores = torch.stack([r[0] for r in rows])  # (B, n, V)
    q = torch.stack([r[1] for r in rows])
    share = [0.0 if kinds[b % len(kinds)] == "equal" else 0.15 for b in range(B)]
    tokens = torch.stack([_tokens(parent[b], q[b], share[b], gen) for b in range(B)])
    u = torch.rand(B, n, generator=gen)
    e = torch.empty(B, V).exponential_(generator=gen)
    return tuple(t.to(DEVICE) for t in (tokens, parent, scores, q, u, e))


def reference(tokens, parent, scores, q, u, e):
    return rejection_walk(tokens, parent, torch.softmax(scores, -1), q, u, e)


def assert_same(got, want, case):
    tokens, parent, scores, q, u, e = case
    bad = sorted({b for g, w in zip(got, want) for b in (g != w).nonzero().flatten().tolist()})
    lines = []
    for b in bad:
        lines.append(f"row {b}: got {[g[b].item() for g in got]}, want {[w[b].item() for w in want]} "
                     f"({', '.join(FIELDS)})")
        lines.append(f"  parent={parent[b].tolist()} tokens={tokens[b].tolist()}")
        lines.append(f"  u={[round(x, 4) for x in u[b].tolist()]}")
    assert not bad and all(g.dtype == torch.int64 for g in got), \
        "Triton sampling walk differs from the torch reference:\n" + "\n".join(lines)


def set_tiling(monkeypatch, block_v: int, num_warps: int = 4) -> None:
    """Replace the kernel's launch rule: small blocks cross many chunks even for small V."""
    monkeypatch.setattr(triton_sampling, "_settings", lambda V: (block_v, num_warps))


def run_both(case):
    got = triton_sampling.rejection_walk_triton(*case)
    want = reference(*case)
    assert_same(got, want, case)
    return want


def first_children(parent: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor):
    """(best, accept_len) of a draft equal to the target: from the root, always the first child x
    with q(x) > 0 (ratio 1, accepted); a child with q(x) == 0 is skipped."""
    cur, acc = 0, 0
    for j in range(1, parent.shape[0]):
        if parent[j].item() == cur and q[cur, tokens[j]].item() > 0:
            cur, acc = j, acc + 1
    return cur, acc


KINDS = ("mixed", "equal", "disjoint", "sparse_q")
# B x (N+1) x V: every combination; rows of B = 3 are of different kinds.
SHAPES = [(B, n, V) for B in (1, 3) for n in (1, 2, 7, 33) for V in (5, 37, 130, 1000)]


@needs_triton
@pytest.mark.parametrize("B, n, V", SHAPES)
def test_matches_reference(monkeypatch, B, n, V):
    seed = B * 1_000_003 + n * 1009 + V
    kinds = KINDS[seed % 4:] + KINDS[:seed % 4]  # B = 1 rows take turns through the kinds
    case = make_case(B, n, V, kinds, seed)
    # Several chunks per pass (and a ragged last one) where the interpreter can afford it.
    if V <= 37 or (V == 130 and B * n <= 7):
        set_tiling(monkeypatch, 16)
    accept_len, best, bonus = (t.cpu() for t in run_both(case))
    tokens, parent, scores, q = (t.cpu() for t in case[:4])
    for b in range(B):
        kind = kinds[b % 4]
        if kind == "equal":
            assert (best[b].item(), accept_len[b].item()) == first_children(parent[b], tokens[b], q[b])
        if kind == "disjoint":
            assert accept_len[b] == 0 and bonus[b] % 2 == 0, "a disjoint draft must be rejected throughout"
        assert scores[b, best[b], bonus[b]] > float("-inf"), "the bonus is a token the target masks"


@needs_triton
@pytest.mark.parametrize("block_v, num_warps", [(16, 4), (64, 1), (256, 8)])
def test_tilings_and_layout(monkeypatch, block_v, num_warps):
    """Block sizes around V = 200; scores and q rows strided past V, int32 trees, bf16 inputs via the dispatch."""
    case = make_case(3, 12, 200, KINDS, seed=block_v)
    set_tiling(monkeypatch, block_v, num_warps)
    run_both(case)
    tokens, parent, scores, q, u, e = case
    wide = torch.zeros(3, 12, 256, device=DEVICE)
    wide[..., :200] = scores
    wide_q = torch.zeros(3, 12, 256, device=DEVICE)
    wide_q[..., :200] = q
    got = verify_sampling(wide[..., :200], wide_q[..., :200], tokens.int(), parent.int(), u, e, backend="triton")
    assert_same(got, reference(*case), case)
    half = (scores.bfloat16(), q.bfloat16())
    want = rejection_walk(tokens, parent, torch.softmax(half[0].float(), -1), half[1], u, e)
    assert_same(verify_sampling(*half, tokens, parent, u, e, backend="triton"), want, case)


@needs_triton
def test_hand_built_walks():
    """Two rows walked by hand (V = 4, root + 3 children, e = 1 so the bonus is p_cur's argmax).
    Row 0: p = one-hot(2), q's root row is raw [0, 0, 2, 0] (used as given, as the reference does): x = 2
    has ratio 1/2, u = 0.7 rejects it, the residual max(p - q, 0) is all zero so p is kept, q without 2
    is empty, so x = 1 is skipped (q(1) = 0) and so is x = 3; bonus 2.
    Row 1: p = [.5, .5, 0, 0], q = [.25, 0, 0, .75]: x = 3 (p = 0) is rejected, p -> [1/3, 2/3, 0, 0] in a
    workspace slot and q -> [1, 0, 0, 0]; x = 0 (ratio 1/3, u = 0.9) is rejected, p -> [0, 1, 0, 0] in the
    other slot and q is empty; x = 1 is skipped; bonus 1."""
    inf = float("-inf")
    scores = torch.tensor([[[inf, inf, 0.0, inf]] * 4, [[0.0, 0.0, inf, inf]] * 4])  # (2, 4, 4)
    q = torch.zeros(2, 4, 4)
    q[0, 0, 2] = 2.0
    q[1, 0] = torch.tensor([0.25, 0.0, 0.0, 0.75])
    tokens = torch.tensor([[0, 2, 1, 3], [0, 3, 0, 1]])
    parent = torch.zeros(2, 4, dtype=torch.long)
    u = torch.tensor([[0.0, 0.7, 0.3, 0.3], [0.0, 0.5, 0.9, 0.5]])
    case = tuple(t.to(DEVICE) for t in (tokens, parent, scores, q, u, torch.ones(2, 4)))
    accept_len, best, bonus = run_both(case)
    assert accept_len.tolist() == [0, 0] and best.tolist() == [0, 0] and bonus.tolist() == [2, 1]


# --- the emitted token's law ----------------------------------------------------------------------------
# One node, k candidates drawn by sample_children from Q: the emitted token (the accepted candidate, else
# the bonus) must follow P. P forbids token 3, which Q favours; Q cannot draw token 0, P's favourite, so
# P's mass at 0 comes from the residual alone. A rule that keeps the target after a rejection emits
# min(P, Q) + (1 - sum min(P, Q)) P instead: TV 0.25 from P.
P = torch.tensor([0.5, 0.35, 0.15, 0.0])
Q = torch.tensor([0.0, 0.35, 0.15, 0.5])
CPU_TRIALS = 240


def _emitted(k: int, trials: int, seed: int) -> torch.Tensor:
    """(trials,) emitted tokens, one kernel launch of ``trials`` rows; each row is a root with k children."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ids, _ = sample_children(Q.log().to(DEVICE).expand(trials, 1, -1), k, gen)  # (T, 1, k) in draw order
    zero = torch.zeros(trials, 1, dtype=torch.long, device=DEVICE)
    tree = Tree(tokens=torch.cat((zero, ids[:, 0]), 1), parent=zero.expand(-1, k + 1),
                depth=torch.cat((zero, zero.expand(-1, k) + 1), 1))
    # Children are leaves: their rows only feed the bonus after an acceptance, which is not looked at.
    scores = P.log().to(DEVICE).expand(trials, k + 1, -1)  # (T, k+1, V) -inf at token 3
    q = Q.to(DEVICE).expand(trials, k + 1, -1)
    accept_len, best, bonus = tree_rejection_sample_scores(tree, scores, q, gen, backend="triton")
    first = tree.tokens.gather(1, best[:, None]).squeeze(1)
    return torch.where(accept_len == 1, first, bonus).cpu()


def _law(k: int, trials: int, seed: int):
    out = _emitted(k, trials, seed)
    return _check(torch.bincount(out, minlength=4) / trials, P, trials)


@needs_triton
def test_emitted_token_follows_the_target():
    # Three times the control's trials (6 s interpreted): at 240 the TV bound (twice the noise's mean) is passed by
    # chance in about one seed of eight; at 720 the seeds tried stayed within 0.65 of it.
    tv, tv_bound, chi2, chi2_bound = _law(2, 3 * CPU_TRIALS, seed=1)
    assert tv < tv_bound and chi2 < chi2_bound, (tv, tv_bound, chi2, chi2_bound)


_REAL_REJECT = triton_sampling._reject


@triton.jit
def _reject_keeps_target(scores_ptr, q_ptr, work_ptr, p_log, p_off, p_max, p_sum, q_in, q_off, q_sum, x,
                         res_off, q_new_off, V, BLOCK_V: tl.constexpr):
    """A WRONG rejection step: the residual reported empty, so the walk keeps the target unchanged."""
    r_sum, q_left = _REAL_REJECT(scores_ptr, q_ptr, work_ptr, p_log, p_off, p_max, p_sum, q_in, q_off, q_sum, x,
                                 res_off, q_new_off, V, BLOCK_V)
    return r_sum * 0.0, q_left


@pytest.mark.skipif(not INTERPRET, reason="swaps a Triton helper at run time, which only the interpreter sees")
def test_wrong_rule_fails_the_same_check(monkeypatch):
    """The control: the same check, on a walk whose rejections keep the target, fails."""
    monkeypatch.setattr(triton_sampling, "_reject", _reject_keeps_target)
    tv, tv_bound, chi2, chi2_bound = _law(2, CPU_TRIALS, seed=1)
    assert tv > 2 * tv_bound and chi2 > 2 * chi2_bound, (tv, tv_bound, chi2, chi2_bound)


@needs_cuda
@pytest.mark.parametrize("k", [1, 2, 4])  # 4: the last draw is past Q's support, skipped
def test_emitted_token_follows_the_target_cuda(k):
    tv, tv_bound, chi2, chi2_bound = _law(k, 40_000, seed=k)
    assert tv < min(tv_bound, 0.02) and chi2 < chi2_bound, (tv, tv_bound, chi2, chi2_bound)


@needs_cuda
@pytest.mark.parametrize("V", [32000, 152064])
def test_real_vocabulary_cuda(V):
    """A real vocabulary: many BLOCK_V chunks per pass, default tiling, all four kinds of row."""
    for seed in range(3):
        run_both(make_case(4, 65, V, KINDS, seed=seed + V))


# --- dispatch ---------------------------------------------------------------------------------------------

@needs_triton
def test_dispatch_backends(monkeypatch):
    case = make_case(3, 7, 37, KINDS, seed=5)
    tokens, parent, scores, q, u, e = case
    want = reference(*case)
    for backend in ("triton", "torch", "auto"):
        assert_same(verify_sampling(scores, q, tokens, parent, u, e, backend=backend), want, case)
    monkeypatch.setenv(ENV_BACKEND, "triton")
    assert_same(verify_sampling(scores, q, tokens, parent, u, e), want, case)


def test_sample_entry_points_agree():
    """tree_rejection_sample_scores draws the same noise as tree_rejection_sample: same results on torch
    (bit for bit) and on Triton (the kernel where it can run)."""
    tokens, parent, scores, q, _, _ = make_case(3, 7, 37, KINDS, seed=9)
    tree = Tree(tokens=tokens, parent=parent, depth=torch.zeros_like(parent))
    want = tree_rejection_sample(tree, torch.softmax(scores, -1), q, torch.Generator(DEVICE).manual_seed(3))
    backends = ("torch", "triton") if INTERPRET or DEVICE == "cuda" else ("torch",)
    for backend in backends:
        got = tree_rejection_sample_scores(tree, scores, q, torch.Generator(DEVICE).manual_seed(3), backend=backend)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), backend
    with pytest.raises(ValueError, match=r"\(3, 7, V\)"):
        tree_rejection_sample_scores(tree, scores[:, :5], q[:, :5])


def test_dispatch_errors(monkeypatch):
    tokens, parent, scores, q, u, e = (t.cpu() for t in make_case(1, 7, 37, KINDS, seed=1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, no interpreter: Triton cannot run
    with pytest.raises(RuntimeError, match="CUDA"):
        verify_sampling(scores, q, tokens, parent, u, e, backend="triton")
    monkeypatch.setenv(ENV_BACKEND, "triton")
    with pytest.raises(RuntimeError, match="CUDA"):
        verify_sampling(scores, q, tokens, parent, u, e)
    monkeypatch.delenv(ENV_BACKEND)
    assert_same(verify_sampling(scores, q, tokens, parent, u, e), reference(tokens, parent, scores, q, u, e),
                (tokens, parent, scores, q, u, e))  # auto -> torch
    with pytest.raises(ValueError, match="unknown"):
        verify_sampling(scores, q, tokens, parent, u, e, backend="cuda")
    bad_shapes = {"scores": (scores[0],), "q": (scores, q[:, :5]), "tokens": (scores, q, tokens[:, :5]),
                  "parent": (scores, q, tokens, parent[:, :5]), "u": (scores, q, tokens, parent, u[:, 1:]),
                  "e": (scores, q, tokens, parent, u, e[:, :-1])}
    full = (scores, q, tokens, parent, u, e)
    for name, head in bad_shapes.items():
        with pytest.raises(ValueError, match=rf"^{name} "):
            verify_sampling(*head, *full[len(head):])
    for name, args in {"scores": (scores.double(), q), "q": (scores, q.long())}.items():
        with pytest.raises(TypeError, match=rf"^{name} dtype"):
            verify_sampling(*args, tokens, parent, u, e)
    with pytest.raises(TypeError, match="parent must be an integer"):
        verify_sampling(scores, q, tokens, parent.float(), u, e)
    with pytest.raises(ValueError, match="needs at least the root"):
        verify_sampling(scores[:, :0], q[:, :0], tokens[:, :0], parent[:, :0], u[:, :0], e)


def test_public_function_survives_kernel_import():
    """Importing the kernel module must not replace eagle_mm.kernels.verify_sampling (the function)."""
    import eagle_mm.kernels as kernels
    from eagle_mm.kernels import dispatch

    dispatch._sampling_module()
    assert callable(kernels.verify_sampling) and kernels.verify_sampling is dispatch.verify_sampling
