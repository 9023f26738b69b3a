"""The Triton verify kernel's two walks (bits and pointer jumping) and the packed argmax's 32-bit key
reduction, against the torch reference or the int64 reduction. Under the Triton interpreter on CPU, like
tests/test_kernels.py (whose helpers these use); with TRITON_INTERPRET=0 on a CUDA machine, compiled."""
import pytest
import torch

from tests.test_kernels import DEVICE, make_case, needs_triton, run_both  # sets TRITON_INTERPRET first

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from eagle_mm.kernels.triton_argmax import _packed_key  # noqa: E402


# (B, N+1, max tree depth): one, two and four 64-bit words of node bits in the bits walk (8 / 128 / 256 lanes),
# and path rows of one and two words (depth < 8, depth 8-15).
WALK_TREES = [(2, 7, None), (2, 100, 4), (1, 200, 6), (1, 30, 12)]


@needs_triton
@pytest.mark.parametrize("fused", (False, True))
@pytest.mark.parametrize("walk", ("bits", "jump"))
@pytest.mark.parametrize("B, n, tree_depth", WALK_TREES)
def test_walks(B, n, tree_depth, walk, fused):
    """Both walks on trees whose node sets take one, two and four words, with and without the path."""
    case = make_case(B, n, 97, torch.float32, seed=n, max_depth=tree_depth)
    got = run_both(*case, walk=walk, fused=fused, block_v=32, splits=2)
    assert got[0][0] > 0, "make_case planted a path in row 0, yet nothing was accepted"
    run_both(*case, with_path=False, walk=walk, fused=fused, block_v=32, splits=2)


def test_walk_option_errors():
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton
    logits, tokens, parent, depth, D = make_case(1, 7, 97, torch.float32, seed=1)
    with pytest.raises(ValueError, match="walk must be"):
        verify_greedy_triton(logits, tokens, parent, depth, D, walk="deep")
    logits, tokens, parent, depth, D = make_case(1, 300, 5, torch.float32, seed=1, max_depth=3)
    with pytest.raises(ValueError, match="got 512 lanes"):  # 300 nodes: 512 lanes, over the bits walk's 256
        verify_greedy_triton(logits, tokens, parent, depth, D, walk="bits")
    logits, tokens, parent, depth, D = make_case(1, 7, 5, torch.float32, seed=1)
    with pytest.raises(ValueError, match="max_depth = 16"):  # a path row of 17 bytes: over the bits walk's 16
        verify_greedy_triton(logits, tokens, parent, depth, 16, walk="bits")


@triton.jit
def _both_keys(cur_ptr, pos_ptr, out_ptr, lo, hi, BLOCK_V: tl.constexpr):
    # `_packed_key` of one row of slots, with the 32-bit reduction (out[0]) and with the int64 one (out[1]).
    offs = tl.arange(0, BLOCK_V)[None, :]
    cur = tl.load(cur_ptr + offs)
    pos = tl.load(pos_ptr + offs)
    tl.store(out_ptr, _packed_key(cur, pos, lo, hi, offs, BLOCK_V, True))
    tl.store(out_ptr + 1, _packed_key(cur, pos, lo, hi, offs, BLOCK_V, False))


@needs_triton
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_packed_short_key(dtype):
    """The packed argmax's 32-bit slot reduction (slices of at most 65536 logits) gives the int64 order key,
    over ties, NaN, +-inf and signed zeros: `_packed_key` with SHORT against without, on random slots."""
    gen = torch.Generator().manual_seed(4)
    specials = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0)
    crafted = []  # (slot, value) over slots of -1, with chunk 0 for every slot: the index is the slot
    for first, then in ((-0.0, 0.0), (0.0, -0.0), (float("nan"), float("nan")), (float("inf"), float("inf")),
                        (float("-inf"), -1.0)):
        crafted.append(((2, first), (9, then)))
    for trial in range(60 + len(crafted)):
        pos = torch.randint(0, 1000, (64,), generator=gen).to(torch.int16)  # chunk numbers: indices < 65536
        pos[0] = 0  # as in the kernel, slot 0 of chunk 0 lies in the slice
        lo = trial * 7
        hi = lo + 1 + torch.randint(0, 64000, (1,), generator=gen).item()
        if trial < len(crafted):  # ties that only the value code's details decide (-0.0 ties +0.0, NaNs tie)
            vals = torch.full((64,), -1.0).to(dtype)
            for slot, value in crafted[trial]:
                vals[slot] = value
            pos[:], hi = 0, lo + 64
        else:
            vals = torch.randn(64, generator=gen).to(dtype)
            for k in torch.randint(0, 64, (trial % 6,), generator=gen).tolist():
                vals[k] = specials[k % 5] if k % 7 else vals.max()
            if trial % 3 == 0:
                vals[:] = vals[trial % 64]  # every slot tied
        out = torch.empty(2, dtype=torch.int64, device=DEVICE)
        _both_keys[(1,)](vals.to(DEVICE), pos.to(DEVICE), out, lo, hi, BLOCK_V=64)
        assert out[0] == out[1], f"trial {trial}: short key {out[0].item()} != {out[1].item()} for {vals.tolist()}"
