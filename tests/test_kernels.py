"""Triton greedy verification vs the torch reference, bit for bit.

On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set below unless already set).
With TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernel on the GPU.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernel module

import pytest  # noqa: E402
import torch  # noqa: E402

from eagle_mm.kernels import verify_greedy, verify_greedy_reference  # noqa: E402
from eagle_mm.kernels.dispatch import ENV_BACKEND  # noqa: E402

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(not INTERPRET and DEVICE == "cpu",
                                  reason="no CUDA device and TRITON_INTERPRET is not 1")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)  # packed argmax, early walk launch
FIELDS = ("accept_len", "best", "bonus", "path", "target")


def random_tree(B: int, n: int, gen: torch.Generator, max_depth: int | None = None):
    """Random valid trees (B, n): parent[i] < i, drawn near i half the time so trees get deep; with
    ``max_depth``, only among the nodes above that depth (wide, shallow trees)."""
    parent = torch.zeros(B, n, dtype=torch.long)
    depth = torch.zeros(B, n, dtype=torch.long)
    for b in range(B):
        for i in range(1, n):
            near = torch.randint(0, 2, (1,), generator=gen).item()
            lo = max(0, i - 3) if near else 0
            p = torch.randint(lo, i, (1,), generator=gen).item()
            if max_depth is not None and depth[b, p] >= max_depth:
                ok = (depth[b, :i] < max_depth).nonzero().flatten()
                p = ok[torch.randint(0, len(ok), (1,), generator=gen)].item()
            parent[b, i], depth[b, i] = p, depth[b, p] + 1
    return parent, depth


def make_case(B: int, n: int, V: int, dtype: torch.dtype, seed: int, max_depth: int | None = None):
    """Logits whose argmax follows a random root-to-node path (so long acceptances happen), with ties.

    Ties: each node's max value is copied to a few other tokens, some before the planted one, so the
    accepted set depends on "ties -> lowest index"; siblings sometimes share a token, so several
    nodes of one depth are accepted and `best` depends on the lowest-index rule too.
    """
    gen = torch.Generator().manual_seed(seed)
    parent, depth = random_tree(B, n, gen, max_depth)
    tokens = torch.randint(0, V, (B, n), generator=gen)
    logits = torch.randn(B, n, V, generator=gen).to(dtype)
    for b in range(B):
        if n > 2:  # a sibling shares its predecessor's token
            i = torch.randint(2, n, (1,), generator=gen).item()
            sib = [j for j in range(1, i) if parent[b, j] == parent[b, i]]
            if sib:
                tokens[b, i] = tokens[b, sib[-1]]
    keep_planted = torch.rand(B, n, 1, generator=gen) < 0.7  # (B, n, 1) no ties added at this node
    for b in range(B):
        node = torch.randint(min(1, n - 1), n, (1,), generator=gen).item()
        while node != 0:  # plant the path's tokens as its parents' argmax
            p = parent[b, node].item()
            logits[b, p, tokens[b, node]] = logits[b, p].float().max().to(dtype) + 1
            keep_planted[b, p] |= b == 0  # row 0 keeps its whole path: it accepts >= 1 token
            node = p
    top = logits.float().amax(-1, keepdim=True)  # (B, n, 1)
    ties = torch.rand(B, n, V, generator=gen) < 2.0 / V
    logits = torch.where(ties & keep_planted.logical_not(), top.to(dtype), logits)
    return logits, tokens, parent, depth, int(depth.max())


def mismatch_report(got, want, inputs) -> str:
    """Name each differing output, the rows it differs on, and each such row's tree and argmaxes."""
    logits, tokens, parent, depth = inputs
    lines, rows = [], set()
    for name, g, w in zip(FIELDS, got, want):
        if g is None and w is None:
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            lines.append(f"{name}: got {tuple(g.shape)} {g.dtype}, want {tuple(w.shape)} {w.dtype}")
            continue
        bad = (g != w).reshape(g.shape[0], -1).any(1).nonzero().flatten().tolist()
        rows.update(bad)
        for b in bad:
            lines.append(f"{name}[{b}]: got {g[b].tolist()}, want {w[b].tolist()}")
    for b in sorted(rows):
        row = logits[b].float()
        lines.append(f"row {b}: parent={parent[b].tolist()} depth={depth[b].tolist()} tokens={tokens[b].tolist()}")
        lines.append(f"row {b}: per-node max={row.amax(-1).tolist()} "
                     f"ties at max={[(r == r.max()).nonzero().flatten().tolist()[:6] for r in row]}")
    return "\n".join(lines)


def assert_same(got, want, inputs):
    same = all(g is None and w is None or (g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w))
               for g, w in zip(got, want))
    assert same, "Triton verify differs from the torch reference:\n" + mismatch_report(got, want, inputs)


def set_tiling(monkeypatch, block_v: int, splits: int, num_warps: int = 4) -> None:
    """Replace the kernel's launch rule (`triton_greedy._settings`): small chunks and several splits even for
    small V. On sm_90 a 16-bit block_v >= 64 still takes the packed loop, else the exact one."""
    from eagle_mm.kernels import triton_greedy
    monkeypatch.setattr(triton_greedy, "_settings", lambda logits, rows: (block_v, num_warps, splits))


def run_both(logits, tokens, parent, depth, max_depth, with_path=True):
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton
    logits, tokens, parent, depth = (t.to(DEVICE) for t in (logits, tokens, parent, depth))
    got = verify_greedy_triton(logits, tokens, parent, depth, max_depth, with_path=with_path)
    want = verify_greedy_reference(logits, tokens, parent, depth, max_depth, with_path=with_path)
    assert_same(got, want, (logits, tokens, parent, depth))
    return got


# B x (N+1) x V; (3, 41, 1) left out: V=1 is covered by the smaller trees and the interpreter pays
# ~5 ms per program.
SHAPES = [(B, n, V) for B in (1, 3) for n in (1, 7, 41) for V in (1, 97, 1271, 4099) if (B, n, V) != (3, 41, 1)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B, n, V", SHAPES)
def test_matches_reference(monkeypatch, B, n, V, dtype):
    case = make_case(B, n, V, dtype, seed=B * 1_000_003 + n * 1009 + V * 7 + DTYPES.index(dtype))
    # The interpreter pays per chunk: a small tiling (many chunks, 3 splits) only where rows x chunks stays small.
    if B * n <= 7 and 1 < V <= 1271:
        set_tiling(monkeypatch, 32, 3)
    # fp16 runs without the path: the path does not depend on the dtype, and both branches get run.
    got = run_both(*case, with_path=dtype != torch.float16)
    if n > 1 and V > 1:  # the construction must really produce acceptances
        assert got[0][0] > 0, "make_case planted a path in row 0, yet nothing was accepted"


# (B, N+1, max tree depth): 8, 128 and 256 walk lanes; a deep narrow tree (4 pointer-jumping rounds).
WALK_TREES = [(2, 7, None), (2, 100, 4), (1, 200, 6), (1, 30, 12)]


@needs_triton
@pytest.mark.parametrize("B, n, tree_depth", WALK_TREES)
def test_walk_tree_sizes(monkeypatch, B, n, tree_depth):
    """Trees of 7 to 200 nodes, shallow and deep, with and without the path."""
    set_tiling(monkeypatch, 32, 2)
    case = make_case(B, n, 97, torch.float32, seed=n, max_depth=tree_depth)
    got = run_both(*case)
    assert got[0][0] > 0, "make_case planted a path in row 0, yet nothing was accepted"
    run_both(*case, with_path=False)


def test_walk_size_limit():
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton
    logits, tokens, parent, depth, D = make_case(1, 7, 5, torch.float32, seed=1)
    with pytest.raises(ValueError, match="at most 1024 nodes"):
        verify_greedy_triton(logits, tokens, parent, depth, 1024)


TILINGS = (None, (16, 1), (16, 64), (64, 5), (64, 2), (128, 3))  # (block_v, splits); None: the launch rule


@needs_triton
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
def test_ties_across_chunks_and_splits(monkeypatch, tiling):
    """Equal maxima in one lane of two chunks, in two splits, and at the two ends: lowest index wins."""
    if tiling:
        set_tiling(monkeypatch, *tiling)
    V = 300
    logits, tokens, parent, depth, D = make_case(2, 7, V, torch.bfloat16, seed=7)
    top = logits.float().amax(-1).max().item() + 2
    for node, where in enumerate(([20, 36], [70, 200], [0, V - 1], [V - 1], [33, 49, 290], [150, 64])):
        logits[0, node, where] = top
    tokens[0, 1] = 20  # the root's argmax (20, not 36): node 1 is accepted
    for node in (2, 3):
        parent[0, node], depth[0, node] = 1, 2
    tokens[0, 2], tokens[0, 3] = 200, 70  # only node 3 carries the lowest tied index at node 1
    got = run_both(logits, tokens, parent, depth, max(D, 2))
    assert got[4][0, :6].tolist() == [20, 70, 0, V - 1, 33, 64] and got[0][0] >= 2


def special_case(dtype):
    """NaN (first wins), all -inf rows (index 0), -0.0 tying +0.0, +inf ties, in 2 rows of 7 nodes, V=300."""
    logits, tokens, parent, depth, D = make_case(2, 7, 300, dtype, seed=3)
    logits[0, 1] = float("-inf")
    logits[0, 2, [250, 40, 170]] = float("nan")
    logits[0, 3] = 0.0
    logits[0, 3, 5] = -0.0
    logits[0, 3, 1] = -0.0
    logits[0, 4, 17] = float("inf")
    logits[0, 4, 33] = float("nan")
    logits[1, 0, [280, 90]] = float("inf")
    logits[1, 4, 299] = float("nan")
    logits[1, 5, 0] = float("nan")
    return logits, tokens, parent, depth, D


@needs_triton
@pytest.mark.parametrize("tiling", (None, (32, 4), (64, 4)), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(monkeypatch, dtype, tiling):
    """NaN beats every number (first NaN wins), all -inf rows pick index 0, -0.0 ties +0.0, +inf ties; on
    sm_90 the 16-bit packed loop redoes a slice with a NaN exactly."""
    if tiling:
        set_tiling(monkeypatch, *tiling)
    run_both(*special_case(dtype))


@pytest.mark.skipif(not SM90, reason="the packed-pair argmax and the early walk launch need sm_90 (not interpreted)")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("tiling", (None, (64, 5), (128, 3), (256, 2), (512, 1)), ids=str)
def test_packed_cuda(monkeypatch, dtype, tiling):
    """The packed argmax against the reference: random shapes, planted ties, and every special value."""
    if tiling:
        set_tiling(monkeypatch, *tiling)
    for B, n, V in ((1, 7, 97), (3, 7, 4099), (1, 41, 1271), (2, 65, 32000), (1, 3, 1)):
        run_both(*make_case(B, n, V, dtype, seed=B * 31 + n * 7 + V))
    run_both(*special_case(dtype))
    V = 300
    logits, tokens, parent, depth, D = make_case(2, 7, V, dtype, seed=7)
    top = logits.float().amax(-1).max().item() + 2
    for node, where in enumerate(([20, 36], [70, 200], [0, V - 1], [V - 1], [33, 49, 290], [150, 64])):
        logits[0, node, where] = top
    run_both(logits, tokens, parent, depth, D)


@pytest.mark.skipif(not SM90, reason="the early walk launch needs sm_90")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_back_to_back_cuda(dtype):
    """Calls on new inputs one after another, with the walk launched early: each reads its own keys."""
    for seed in range(3):
        run_both(*make_case(3, 41, 32000, dtype, seed=seed))


@needs_triton
def test_split_merge_in_several_tiles(monkeypatch):
    """The walk merges the splits' keys a tile of columns at a time; with 2-column tiles, 5 splits take
    three loads (the last one half masked), and ties across splits still go to the lowest index."""
    from eagle_mm.kernels import triton_greedy
    monkeypatch.setattr(triton_greedy, "_MERGE_TILE", 128)  # block 64 (at least; N+1 = 7) -> 2 splits per tile
    set_tiling(monkeypatch, 16, 5)
    V = 300
    logits, tokens, parent, depth, D = make_case(2, 7, V, torch.float32, seed=11)
    top = logits.amax(-1).max().item() + 2
    logits[1, 2, [290, 10, 150]] = top  # splits 4, 0 and 2 of 5 (block_v 16: chunks of 64)
    got = run_both(logits, tokens, parent, depth, D)
    assert got[4][1, 2].item() == 10


@needs_triton
def test_tokens_beyond_int32_never_match():
    """The walk compares tokens in int32: one that only equals the argmax modulo 2**32 must not match."""
    logits, tokens, parent, depth, D = make_case(1, 7, 97, torch.float32, seed=5)
    children = (parent[0] == 0).nonzero().flatten()
    children = children[children > 0]
    top = logits[0, 0].argmax().item()
    tokens[0, children] = top + 2**32  # the root's argmax, plus 2**32: equal in int32
    tokens[0, children[1:]] = top - 2**32  # and minus
    got = run_both(logits, tokens, parent, depth, D)  # bit-exact against the reference, which accepts nothing
    assert got[0][0].item() == 0


@needs_triton
def test_extra_depth_and_layout():
    """max_depth above the tree's depth (path padding), non-contiguous logits, int32 index tensors."""
    logits, tokens, parent, depth, D = make_case(3, 7, 97, torch.float16, seed=11)
    logits, tokens, parent, depth = (t.to(DEVICE) for t in (logits, tokens, parent, depth))
    wide = torch.zeros(3, 7, 120, dtype=torch.float16, device=DEVICE)
    wide[:, :, :97] = logits
    want = verify_greedy_reference(logits, tokens, parent, depth, D + 3, with_path=True)
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton
    got = verify_greedy_triton(wide[:, :, :97], tokens, parent.int(), depth.int(), D + 3, with_path=True)
    assert_same(got, want, (logits, tokens, parent, depth))


@needs_triton
def test_dispatch_backends(monkeypatch):
    logits, tokens, parent, depth, D = make_case(3, 7, 97, torch.bfloat16, seed=5)
    logits, tokens, parent, depth = (t.to(DEVICE) for t in (logits, tokens, parent, depth))
    want = verify_greedy_reference(logits, tokens, parent, depth, D, with_path=True)
    for backend in ("triton", "torch", "auto"):
        got = verify_greedy(logits, tokens, parent, depth, D, with_path=True, backend=backend)
        assert_same(got + (want[4],), want, (logits, tokens, parent, depth))
        assert len(verify_greedy(logits, tokens, parent, depth, D, backend=backend)) == 3
    monkeypatch.setenv(ENV_BACKEND, "triton")
    assert torch.equal(verify_greedy(logits, tokens, parent, depth, D)[1], want[1])


def test_dispatch_errors(monkeypatch):
    logits, tokens, parent, depth, D = make_case(1, 7, 97, torch.float32, seed=1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, no interpreter: Triton cannot run
    with pytest.raises(RuntimeError, match="CUDA"):
        verify_greedy(logits, tokens, parent, depth, D, backend="triton")
    monkeypatch.setenv(ENV_BACKEND, "triton")
    with pytest.raises(RuntimeError, match="CUDA"):
        verify_greedy(logits, tokens, parent, depth, D)
    monkeypatch.delenv(ENV_BACKEND)
    assert verify_greedy(logits, tokens, parent, depth, D)[0].dtype == torch.int64  # auto -> torch
    with pytest.raises(ValueError, match="unknown"):
        verify_greedy(logits, tokens, parent, depth, D, backend="cuda")
    with pytest.raises(ValueError, match="must be"):
        verify_greedy(logits, tokens[:, :5], parent, depth, D)
    with pytest.raises(TypeError, match="dtype"):
        verify_greedy(logits.double(), tokens, parent, depth, D)
    with pytest.raises(ValueError, match="max_depth"):
        verify_greedy(logits, tokens, parent, depth, -1)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_sweep(monkeypatch, seed):
    """Bigger trees (up to 256 nodes, the spec's limit) and real-vocabulary-sized V."""
    B = 1 + seed % 2
    n = (64, 129, 256)[seed % 3]
    V = (32000, 7919)[seed % 2]
    if seed % 3 == 1:
        set_tiling(monkeypatch, 1024, 2)
    run_both(*make_case(B, n, V, DTYPES[seed % 3], seed=seed))


def test_public_function_survives_kernel_import():
    """Importing the kernel module must not replace eagle_mm.kernels.verify_greedy (the function)."""
    import eagle_mm.kernels as kernels
    from eagle_mm.kernels import dispatch

    dispatch._triton_module()
    assert callable(kernels.verify_greedy) and kernels.verify_greedy is dispatch.verify_greedy
