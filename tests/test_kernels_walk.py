"""The Triton verify kernel's two walks (bits and pointer jumping) and the packed argmax's 32-bit key
reduction, against the torch reference or the int64 reduction. Under the Triton interpreter on CPU, like
tests/test_kernels.py (whose helpers these use); with TRITON_INTERPRET=0 on a CUDA machine, compiled."""
import pytest
import torch

from tests.test_kernels import DEVICE, SM90, counter_key, make_case, needs_triton, run_both  # sets TRITON_INTERPRET

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
    with pytest.raises(ValueError, match="wait must be .* got 'soon'"):
        verify_greedy_triton(logits, tokens, parent, depth, D, wait="soon")
    with pytest.raises(ValueError, match="wait='keys' is for the two-launch kernel"):
        verify_greedy_triton(logits, tokens, parent, depth, D, wait="keys", fused=True)


def key_slots() -> list:
    """The wait="keys" slot buffers on DEVICE (one per stream used)."""
    from eagle_mm.kernels import triton_greedy
    return [buf for (dev, _), buf in triton_greedy._KEY_SLOTS.items() if dev == counter_key()]


def assert_slots_empty(what: str) -> None:
    from eagle_mm.kernels.triton_walk import EMPTY
    bufs = key_slots()
    assert bufs, f"{what}: no key slot buffer on {DEVICE}"
    for buf in bufs:
        full = (buf != EMPTY).nonzero().flatten()
        assert full.numel() == 0, f"{what}: slots {full[:8].tolist()} still hold keys"


@needs_triton
@pytest.mark.parametrize("walk", ("bits", "jump"))
def test_wait_keys(monkeypatch, walk):
    """wait="keys": the walk reads the key slots themselves (polling while a slot is EMPTY; on sm_90 with pdl,
    each lane spins on its slots while the argmax still runs) and empties them. Consecutive calls of other
    shapes and inputs reuse the slots: each is right only if the slots it reads hold its own keys, and every
    slot is EMPTY after every call. Splits over several merge tiles (the last one partly masked)."""
    from eagle_mm.kernels import triton_greedy
    monkeypatch.setattr(triton_greedy, "_MERGE_TILE", 16)  # block 8 -> 2 splits per tile
    pdl = {"pdl": True} if SM90 else {}
    for call, (B, n, V, splits) in enumerate(((2, 7, 300, 5), (3, 5, 97, 2), (1, 7, 4099, 3), (2, 7, 300, 5))):
        logits, tokens, parent, depth, D = make_case(B, n, V, torch.float32, seed=200 + call)
        logits[B - 1, 2, [V - 10, 10]] = logits[B - 1, 2].max() + 1  # a tie across the first and last split
        got = run_both(logits, tokens, parent, depth, D, block_v=16, splits=splits, walk=walk, wait="keys", **pdl)
        assert got[4][B - 1, 2].item() == 10
        assert_slots_empty(f"call {call}")


def test_spin_keys():
    """The spinning wait takes 4 slots at a time where every thread holds a multiple of 4, else 2 or 1."""
    from eagle_mm.kernels.triton_walk import KEYS_SPIN, spin_keys
    assert [spin_keys(slots, 128) - KEYS_SPIN for slots in (16, 128, 256, 512, 2048)] == [0, 0, 1, 2, 2]
    assert spin_keys(8192, 256) - KEYS_SPIN == 2


@pytest.mark.skipif(not SM90, reason="pdl and the spinning walk need a CUDA GPU of compute capability >= 9.0")
@pytest.mark.parametrize("splits, walk_warps", ((4, 4), (2, 4), (1, 4), (16, 8), (4, 1)))
def test_wait_keys_spin_packs(splits, walk_warps):
    """The spinning wait with 4, 2 and 1 slots per wait (512, 256 and 128 slots over 128 threads; 8 warps; 1
    warp), back to back on new inputs; the slots are EMPTY after each call."""
    for seed in range(3):
        case = make_case(2, 65, 32000, torch.bfloat16, seed=300 + seed)
        run_both(*case, pdl=True, wait="keys", splits=splits, walk_warps=walk_warps)
        assert_slots_empty(f"splits={splits}, seed={seed}")


@needs_triton
def test_key_slot_growth(monkeypatch):
    """A call needing more slots than the cached buffer holds gets a new, filled one (the old one kept alive, as
    a captured graph may use it); a smaller call then runs on the new one."""
    from eagle_mm.kernels import triton_greedy
    from eagle_mm.kernels.triton_walk import EMPTY
    small = torch.full((8,), EMPTY, dtype=torch.int64, device=DEVICE)
    stream = torch.cuda.current_stream().cuda_stream if DEVICE == "cuda" else 0
    monkeypatch.setattr(triton_greedy, "_KEY_SLOTS", {(counter_key(), stream): small})
    monkeypatch.setattr(triton_greedy, "_RETIRED", [])
    for B, n, V in ((1, 3, 40), (5, 3, 37), (2, 3, 40)):  # 6 slots, 30, 12 (2 splits)
        run_both(*make_case(B, n, V, torch.float32, seed=B), wait="keys", block_v=16, splits=2)
        assert_slots_empty(f"B={B}")
    assert triton_greedy._RETIRED == [small]
    assert key_slots()[0].numel() >= 30


@pytest.mark.skipif(not SM90, reason="pdl and the spinning walk need a CUDA GPU of compute capability >= 9.0")
def test_wait_keys_cuda_graph():
    """Captured in a CUDA graph: warmed up on the capture stream, the graph uses that stream's slots; not warmed
    up, it fills fresh slots at each replay. Both replay right on new inputs, and leave the slots EMPTY."""
    from eagle_mm.kernels.triton_greedy import verify_greedy_triton
    from eagle_mm.kernels.reference import verify_greedy_reference
    D = 8  # every tree below is at most this deep
    case = [t.to(DEVICE) for t in make_case(2, 41, 32000, torch.bfloat16, seed=9, max_depth=D)[:4]]
    for warm in (True, False):
        stream = torch.cuda.Stream()
        if warm:
            with torch.cuda.stream(stream):
                verify_greedy_triton(*case, D, with_path=True, wait="keys")
            stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            got = verify_greedy_triton(*case, D, with_path=True, wait="keys")
        for seed in range(3):
            fresh = make_case(2, 41, 32000, torch.bfloat16, seed=10 + seed, max_depth=D)
            for dst, src in zip(case, fresh):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            want = verify_greedy_reference(*case, D, with_path=True)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), f"warm={warm}, replay {seed}"
        assert_slots_empty(f"warm={warm}")


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
