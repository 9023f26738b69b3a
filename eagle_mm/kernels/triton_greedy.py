"""Triton greedy tree verification: the argmax over the vocabulary, then the walk down the tree.

Two launches, and nothing read back to the host:
  `_argmax_partial`, grid (R = B*(N+1) row-nodes, S splits): program (r, s) reduces its slice of
      logits[r] to one int64 order key (`_order_key`: the max of keys is torch.argmax's winner) at
      part_key[s, r]. Splitting V lets a small tree still fill every SM; the memory floor is reading the
      (B, N+1, V) logits once.
  `_walk_tree`, grid (B,): one program per row merges the splits' keys (a max), marks the accepted nodes by
      pointer jumping and finds the deepest one, its bonus token and its path.
On sm_90+ (Hopper) two things make it faster, with the same results bit for bit:
  - fp16/bf16 logits are compared two per 32-bit register (`_PAIR_ASM`: three instructions per pair instead
    of an fp32 upcast, compares and selects per logit). Its order for NaN is not torch's, so a slice that
    holds a NaN is redone by the exact loop.
  - the walk is launched early (programmatic dependent launch): it loads its tree while the argmax runs, then
    waits for the whole argmax grid (`gdc_wait`) before it reads a key, which hides its launch.
Launch settings come from one rule (`_settings`). Order is torch.argmax's: the largest value, ties -> lowest
index, any NaN above every number (the first NaN wins); values are compared exactly (an fp32 upcast of
fp16/bf16 is exact).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: the walk is never launched early
    gdc_launch_dependents = gdc_wait = None

__all__ = ["verify_greedy_triton"]

_MIN_KEY = tl.constexpr(-9223372036854775807)  # below every order key
_MIN_BLOCK = 64  # lanes of the walk at least
_MAX_SPLITS = 64  # splits of the argmax over V at most (``_settings``)
_MERGE_TILE = 8192  # int64 keys per merge load in the walk (tests shrink it to run several tiles)


# --- argmax ------------------------------------------------------------------------------------------

@triton.jit
def _order_key(val, idx):
    """(value, index) -> int64 whose max is torch.argmax's winner: the largest value, any NaN above
    every number, then the lowest index. val fp32, idx int32 in [0, 2**31 - 1)."""
    val = tl.where(val == 0, 0.0, val)  # -0.0 ties +0.0, as in torch
    bits = val.to(tl.int32, bitcast=True)
    # Flip the magnitude bits of negatives: the int32 order becomes the float order.
    key = tl.where(val != val, 2147483647, bits ^ ((bits >> 31) & 2147483647))
    return (key.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


@triton.jit
def _slice_bounds(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n):
    """Row-node r's logits and split s's slice [lo, hi) of them."""
    b = r // n_nodes
    node = r % n_nodes
    base = logits_ptr + b.to(tl.int64) * stride_b + node.to(tl.int64) * stride_n
    lo = s * chunk
    return base, lo, tl.minimum(lo + chunk, V)


@triton.jit
def _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V: tl.constexpr):
    """Order key (int64 scalar) of logits[r // n_nodes, r % n_nodes, s*chunk : (s+1)*chunk], any dtype."""
    base, lo, hi = _slice_bounds(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n)
    lanes = tl.arange(0, BLOCK_V)
    # Each lane keeps its own (max, first index); starting at the lane's first index makes a lane of
    # -inf values answer that index, as torch does.
    cur_val = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    cur_idx = lo + lanes
    for start in range(lo, hi, BLOCK_V):
        idx = start + lanes
        val = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        # Indices grow along a lane, so only a strictly better value moves it: not(val <= cur) is
        # "greater, or val is NaN"; once cur is NaN it stays (the first NaN wins).
        take = (idx < hi) & ~(val <= cur_val) & (cur_val == cur_val)
        cur_val = tl.where(take, val, cur_val)
        cur_idx = tl.where(take, idx, cur_idx)
    key = tl.where(cur_idx < hi, _order_key(cur_val, cur_idx), _MIN_KEY)
    return tl.max(key, axis=0)


# Two 16-bit logits per 32-bit register, three instructions per pair (sm_90): lanes where the new value is
# strictly greater (set.gt: 0xFFFF per half, never for NaN), the running max (max.NaN: a NaN sticks, so
# the slice is redone exactly), and the chunk number of each half's max (lop3: mask ? step : pos).
_PAIR_ASM = """{
.reg .b32 m;
set.gt.u32.%(t)s m, $2, $3;
max.NaN.%(t)s $0, $3, $2;
lop3.b32 $1, $4, $5, m, 0xD8;
}"""
_PAIR_BF16 = tl.constexpr(_PAIR_ASM % {"t": "bf16x2"})
_PAIR_F16 = tl.constexpr(_PAIR_ASM % {"t": "f16x2"})


@triton.jit
def _pair_update(val, cur, pos, it):
    # val, cur (BLOCK_V,) bf16/fp16; pos (BLOCK_V,) int16; it: int16 chunk number of val.
    if val.dtype == tl.bfloat16:
        out = tl.inline_asm_elementwise(_PAIR_BF16, "=r,=r,r,r,r,r", [val, cur, pos, it],
                                        dtype=(tl.bfloat16, tl.int16), is_pure=True, pack=2)
    else:
        out = tl.inline_asm_elementwise(_PAIR_F16, "=r,=r,r,r,r,r", [val, cur, pos, it],
                                        dtype=(tl.float16, tl.int16), is_pure=True, pack=2)
    return out


@triton.jit
def _slice_key_packed(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V: tl.constexpr):
    """`_slice_key` for fp16/bf16 logits on sm_90, in packed pairs: each of the BLOCK_V slots keeps its max
    and the chunk it came from; a NaN anywhere redoes the slice exactly."""
    base, lo, hi = _slice_bounds(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n)
    n_full = (hi - lo) // BLOCK_V
    offs = tl.arange(0, BLOCK_V)
    cur = tl.full((BLOCK_V,), float("-inf"), logits_ptr.dtype.element_ty)
    pos = tl.zeros((BLOCK_V,), tl.int16)  # a slot of -inf answers its first index, as torch
    for it in range(0, n_full):
        # evict_first: each logit is read once (0.2-0.4 us less than plain loads at N=64, V=128k on an H200)
        val = tl.load(base + lo + it * BLOCK_V + offs, eviction_policy="evict_first")
        cur, pos = _pair_update(val, cur, pos, it.to(tl.int16))
    if lo + n_full * BLOCK_V < hi:  # the slice's partial chunk, masked
        idx = lo + n_full * BLOCK_V + offs
        val = tl.load(base + idx, mask=idx < hi, other=float("-inf"))
        cur, pos = _pair_update(val, cur, pos, n_full.to(tl.int16))
    idx = lo + pos.to(tl.int32) * BLOCK_V + offs
    key = tl.max(tl.where(idx < hi, _order_key(cur.to(tl.float32), idx), _MIN_KEY), axis=0)
    # A NaN orders above every number, so the slice saw one iff the best key holds NaN's value bits. Its
    # position in a packed slot is not the first NaN's: redo the slice exactly.
    if (key >> 32) == 2147483647:
        key = _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V)
    return key


# Sizes that vary with the tree and the batch are not specialized on (Triton compiles a variant per value that is 1
# or a multiple of 16): one build serves every tree, where each new size used to compile again (nine builds, 2.7 s,
# in a first call on a fresh H100, most of them for the chooser's probe of seven tree sizes).
@triton.jit(do_not_specialize=["n_nodes", "R"])
def _argmax_partial(logits_ptr, part_key_ptr, n_nodes, V, chunk, stride_b, stride_n, R,
                    BLOCK_V: tl.constexpr, PACKED: tl.constexpr, PDL: tl.constexpr):
    # grid (R = B * (N+1), S): program (row-node r, split s) -> part_key[s, r].
    if PDL:  # the walk may launch now; it waits (gdc_wait) for this whole grid before reading a key
        gdc_launch_dependents()
    r = tl.program_id(0)
    s = tl.program_id(1)
    if PACKED:
        key = _slice_key_packed(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V)
    else:
        key = _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V)
    tl.store(part_key_ptr + s.to(tl.int64) * R + r, key)


# --- walk --------------------------------------------------------------------------------------------

@triton.jit
def _merged_target(part_key_ptr, rows, live, S, R, BLOCK: tl.constexpr, S_TILE: tl.constexpr):
    """(BLOCK,) int64: the target's argmax after each node, from the max of its splits' keys part_key[s, r]
    (the order keys compose). S_TILE splits per load, each split's keys contiguous over the nodes."""
    s_ids = tl.arange(0, S_TILE)
    key = tl.full((BLOCK,), _MIN_KEY, tl.int64)
    for s0 in range(0, S, S_TILE):
        ptrs = part_key_ptr + (s0 + s_ids)[:, None].to(tl.int64) * R + rows[None, :]
        m = ((s0 + s_ids) < S)[:, None] & live[None, :]
        key = tl.maximum(key, tl.max(tl.load(ptrs, mask=m, other=_MIN_KEY), axis=0))  # (S_TILE, BLOCK) -> (BLOCK,)
    return 2147483647 - (key & 2147483647)  # the index half of the order key


@triton.jit
def _accepted(ok, parent, lift_rounds):
    """(BLOCK,) int32 flags: node i and every ancestor matched their parent's choice (ok, int1).
    Pointer jumping: after k rounds flag[i] covers i and its 2**k - 1 nearest ancestors (the root is its
    own parent), so ceil(log2(max_depth + 1)) rounds cover every chain; one gather per round, of
    (ancestor, flag) packed in one int32."""
    anc = parent
    flag = ok.to(tl.int32)
    for _round in range(0, lift_rounds):
        packed = tl.gather((anc << 1) | flag, anc, 0)
        flag = flag & packed
        anc = packed >> 1
    return flag


@triton.jit(do_not_specialize=["n_nodes", "S", "R", "lift_rounds", "max_depth"])
def _walk_tree(part_key_ptr, tokens_ptr, parent_ptr, depth_ptr, target_ptr, accept_ptr, best_ptr, bonus_ptr,
               path_ptr, n_nodes, S, R, lift_rounds, max_depth, stride_tok, stride_par, stride_dep,
               BLOCK: tl.constexpr, S_TILE: tl.constexpr, WITH_PATH: tl.constexpr, PDL: tl.constexpr):
    # grid (B,): program b walks row b's tree; every vector is (BLOCK,) >= max(N+1, D+1) lanes, one per node.
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    live = i < n_nodes
    tokens = tl.load(tokens_ptr + b.to(tl.int64) * stride_tok + i, mask=live, other=-1).to(tl.int64)
    # int32 below (it halves the gathers); a token outside [0, 2**31) matches no argmax, and stays so as -1
    tokens = tl.where((tokens >= 0) & (tokens < 2147483648), tokens, -1).to(tl.int32)
    parent = tl.load(parent_ptr + b.to(tl.int64) * stride_par + i, mask=live, other=0).to(tl.int32)
    depth = tl.load(depth_ptr + b.to(tl.int64) * stride_dep + i, mask=live, other=0).to(tl.int32)
    if PDL:  # launched early: the argmax grid may still be running
        gdc_wait()
    rows = b.to(tl.int64) * n_nodes + i  # row-node ids, as the argmax grid numbers them
    target = _merged_target(part_key_ptr, rows, live, S, R, BLOCK, S_TILE)  # (BLOCK,) int64 < 2**31
    tl.store(target_ptr + rows, target, mask=live)
    target = target.to(tl.int32)

    # greedy_accept: a node is accepted when it matches its parent's choice and so does every ancestor.
    ok = ((tokens == tl.gather(target, parent, 0)) | (i == 0)) & live
    flag = _accepted(ok, parent, lift_rounds)
    # The deepest accepted node, lowest index on ties, in one max: depth above, 65535 - index below.
    top = tl.max(tl.where((flag != 0) & live, (depth << 16) | (65535 - i), -1), axis=0)
    best = 65535 - (top & 65535)
    accept = top >> 16
    tl.store(accept_ptr + b, accept.to(tl.int64))
    tl.store(best_ptr + b, best.to(tl.int64))
    tl.store(bonus_ptr + b, tl.sum(tl.where(i == best, target, 0), axis=0).to(tl.int64))
    if WITH_PATH:  # path_indices: column j holds parent^max(d - j, 0)(best), d = depth[best] = accept
        node = tl.full((BLOCK,), 0, tl.int32) + best
        hops = accept - i
        for step in range(0, max_depth):
            node = tl.where(step < hops, tl.gather(parent, node, 0), node)
        tl.store(path_ptr + b.to(tl.int64) * (max_depth + 1) + i, node.to(tl.int64), mask=i <= max_depth)


# --- launch ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, bool]:
    """(SM count, sm_90 or newer) of CUDA device ``index``."""
    return (torch.cuda.get_device_properties(index).multi_processor_count,
            torch.cuda.get_device_capability(index) >= (9, 0))


def _hopper(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())[1]


def _settings(logits: torch.Tensor, rows: int) -> tuple[int, int, int]:
    """(block_v, num_warps, splits) of the argmax grid: the one launch rule.

    Packed fp16/bf16 on sm_90: chunks of 2048 logits over 16 warps, 2 programs per SM; the exact loop:
    chunks of up to 2048 over 8 warps (4 below 2048), 4 programs per SM (the best of sweeps over block_v,
    warps and programs per SM on an H200 at N=64, V=128k). The splits fill every SM that many times,
    rounded down (one program more on some SMs costs a whole slice of time), never more than the chunks."""
    V = logits.shape[-1]
    if _hopper(logits.device) and logits.dtype in (torch.float16, torch.bfloat16):
        block_v, num_warps, per_sm = 2048, 16, 2
    else:
        block_v = min(2048, triton.next_power_of_2(V))
        num_warps, per_sm = (8 if block_v >= 2048 else 4), 4
    if logits.device.type != "cuda":
        return block_v, num_warps, 1
    index = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    return block_v, num_warps, max(1, min(per_sm * _device_facts(index)[0] // rows, triton.cdiv(V, block_v), _MAX_SPLITS))


def verify_greedy_triton(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                         depth: torch.Tensor, max_depth: int, *, with_path: bool = False):
    """Triton greedy verification; see `eagle_mm.kernels.dispatch.verify_greedy` for the contract.

    Returns (accept_len, best, bonus, path or None, target) with target (B, N+1) the per-node argmax, equal
    bit for bit to `eagle_mm.kernels.reference.verify_greedy_reference` (tests/test_kernels.py, on a GPU
    and under the interpreter).
    """
    B, n_nodes, V = logits.shape
    # At least 64 lanes: every tree up to 63 nodes shares one build (a lane past the tree costs nothing to speak of).
    block = max(_MIN_BLOCK, triton.next_power_of_2(max(n_nodes, max_depth + 1)))
    if block > 1024:
        raise ValueError(f"the walk holds at most 1024 nodes per row, got max(N+1, max_depth+1) = "
                         f"{max(n_nodes, max_depth + 1)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tree_tokens, parent, depth = (t if t.stride(-1) == 1 else t.contiguous() for t in (tree_tokens, parent, depth))
    block_v, num_warps, splits = _settings(logits, B * n_nodes)
    # Packed pairs need two logits per thread, 32 threads a warp.
    packed = _hopper(logits.device) and logits.dtype in (torch.float16, torch.bfloat16) and block_v >= 64
    if packed:
        num_warps = min(num_warps, block_v // 64)
    chunk = triton.cdiv(triton.cdiv(V, splits), block_v) * block_v  # whole chunks per split
    S = triton.cdiv(V, chunk)  # no split starts past V
    if packed and chunk // block_v >= 2**15:  # the packed loop counts chunks in int16
        raise ValueError(f"V={V} is {chunk // block_v} chunks of {block_v} per split, over the packed loop's 32767")
    pdl = gdc_wait is not None and _hopper(logits.device)

    # One allocation (host time counts at these sizes), cut into contiguous int64 pieces.
    sizes = (B * n_nodes * S, B * n_nodes, B, B, B, B * (max_depth + 1) if with_path else 0)
    buf = torch.empty(sum(sizes), dtype=torch.int64, device=logits.device)
    part_key, target, accept, best, bonus, path = torch.split(buf, sizes)  # part_key: (S, B*(N+1)) keys
    target, path = target.view(B, n_nodes), path.view(B, -1)
    _argmax_partial[(B * n_nodes, S)](logits, part_key, n_nodes, V, chunk, logits.stride(0), logits.stride(1),
                                      B * n_nodes, BLOCK_V=block_v, PACKED=packed, PDL=pdl, num_warps=num_warps)
    # (s_tile, block) keys per load: every split count (at most _MAX_SPLITS) in one tile, one build for all
    s_tile = min(_MAX_SPLITS, max(1, _MERGE_TILE // block))
    launch = {"launch_pdl": True} if pdl else {}  # the interpreter knows no such option
    # ceil(log2(max_depth + 1)) pointer-jumping rounds cover every chain.
    _walk_tree[(B,)](part_key, tree_tokens, parent, depth, target, accept, best, bonus,
                     path if with_path else best, n_nodes, S, B * n_nodes, max_depth.bit_length(), max_depth,
                     tree_tokens.stride(0), parent.stride(0), depth.stride(0), BLOCK=block, S_TILE=s_tile,
                     WITH_PATH=with_path, PDL=pdl, num_warps=4 if block <= 256 else 8, **launch)
    return accept, best, bonus, (path if with_path else None), target
