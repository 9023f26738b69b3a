"""Triton argmax over the vocabulary for greedy verification: one int64 order key per (row-node, split).

One program per (row-node r, split s) streams logits[r, s*chunk : (s+1)*chunk] and reduces it to the
slice's (max, first index), packed in one int64 order key (`_order_key`); the keys of a node's splits
compose by max. Splitting V lets a small tree still fill every SM. Two loops, same keys bit for bit:

  exact (`_slice_key`): each lane keeps (max, first index) in fp32 / int32 over BLOCK_V chunks (UNROLL=2:
  two chunks' loads in flight per step; STAGES > 1: Triton's software pipelining). Any dtype, interpreter too.
  packed (`_slice_key_packed`, fp16/bf16 on sm_90+): two logits per 32-bit register and three instructions
  per pair (`_PAIR_ASM`), each of TILE x BLOCK_V slots keeping its max and the chunk it came from. Its
  order for NaN is not torch's, so a slice holding a NaN is redone by the exact loop. Its slots reduce to
  the key as 32-bit (value code, index) pairs when the slice spans at most 65536 logits (`_packed_key`).

Order is torch.argmax's: the largest value, ties -> lowest index, any NaN above every number (the first
NaN wins). Values are compared exactly (an fp32 upcast of fp16/bf16 is exact).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["short_key"]  # and Triton device functions, used by triton_greedy


def short_key(packed: bool, chunk: int) -> bool:
    """`_packed_key`'s SHORT: the packed loop's slots reduce as int32 when a slice's index fits 16 bits."""
    return packed and chunk <= 65536


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
def _take(cur_val, cur_idx, val, idx, inb):
    # Indices grow along a lane, so only a strictly better value moves it: not(val <= cur) is
    # "greater, or val is NaN"; once cur is NaN it stays (the first NaN wins).
    take = inb & ~(val <= cur_val) & (cur_val == cur_val)
    return tl.where(take, val, cur_val), tl.where(take, idx, cur_idx)


@triton.jit
def _step(base, start, lanes, hi, cur_val, cur_idx, BLOCK_V: tl.constexpr, UNROLL: tl.constexpr):
    """Merge UNROLL chunks from ``start`` into the lanes' (max, first index)."""
    idx = start + lanes
    val = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
    if UNROLL == 2:  # both loads issued before either compare: two chunks in flight per program
        idx2 = idx + BLOCK_V
        val2 = tl.load(base + idx2, mask=idx2 < hi, other=float("-inf")).to(tl.float32)
    cur_val, cur_idx = _take(cur_val, cur_idx, val, idx, idx < hi)
    if UNROLL == 2:  # the later chunk second: a lane's indices still grow in merge order
        cur_val, cur_idx = _take(cur_val, cur_idx, val2, idx2, idx2 < hi)
    return cur_val, cur_idx


@triton.jit
def _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n,
               BLOCK_V: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr):
    """Order key (int64 scalar) of logits[r // n_nodes, r % n_nodes, s*chunk : (s+1)*chunk]."""
    b = r // n_nodes
    node = r % n_nodes
    base = logits_ptr + b.to(tl.int64) * stride_b + node.to(tl.int64) * stride_n
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    lanes = tl.arange(0, BLOCK_V)
    # Each lane keeps its own (max, first index); starting at the lane's first index makes a lane of
    # -inf values answer that index, as torch does.
    cur_val = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    cur_idx = lo + lanes
    if STAGES > 1:  # Triton's software pipelining: later chunks' loads issued while this one is compared
        for start in tl.range(lo, hi, BLOCK_V * UNROLL, num_stages=STAGES):
            cur_val, cur_idx = _step(base, start, lanes, hi, cur_val, cur_idx, BLOCK_V, UNROLL)
    else:
        for start in range(lo, hi, BLOCK_V * UNROLL):
            cur_val, cur_idx = _step(base, start, lanes, hi, cur_val, cur_idx, BLOCK_V, UNROLL)
    key = tl.where(cur_idx < hi, _order_key(cur_val, cur_idx), -9223372036854775807)
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
    # val, cur (TILE, BLOCK_V) bf16/fp16; pos (TILE, BLOCK_V) int16; it: int16 chunk number of val.
    if val.dtype == tl.bfloat16:
        out = tl.inline_asm_elementwise(_PAIR_BF16, "=r,=r,r,r,r,r", [val, cur, pos, it],
                                        dtype=(tl.bfloat16, tl.int16), is_pure=True, pack=2)
    else:
        out = tl.inline_asm_elementwise(_PAIR_F16, "=r,=r,r,r,r,r", [val, cur, pos, it],
                                        dtype=(tl.float16, tl.int16), is_pure=True, pack=2)
    return out


@triton.jit
def _packed_scan(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n,
                 BLOCK_V: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr, CACHE: tl.constexpr,
                 EVICT: tl.constexpr):
    """The packed loop over program (r, s)'s slice: (cur, pos, lo, hi, offs), each of the TILE x BLOCK_V
    slots' max and the chunk it came from (`_pair_update`), the slice's bounds and the slots' offsets.
    CACHE, EVICT: the full chunks' loads' cache modifier and eviction policy (the library: "" and
    "evict_first"; bench/probe_argmax.py times others)."""
    b = r // n_nodes
    node = r % n_nodes
    base = logits_ptr + b.to(tl.int64) * stride_b + node.to(tl.int64) * stride_n
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    STEP: tl.constexpr = TILE * BLOCK_V
    n_full = (hi - lo) // STEP
    offs = tl.arange(0, TILE)[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]  # (TILE, BLOCK_V)
    cur = tl.full((TILE, BLOCK_V), float("-inf"), logits_ptr.dtype.element_ty)
    pos = tl.zeros((TILE, BLOCK_V), tl.int16)  # a slot of -inf answers its first index, as torch
    if STAGES > 1:  # Triton's software pipelining: later chunks' loads in flight while this one is merged
        for it in tl.range(0, n_full, num_stages=STAGES):
            val = tl.load(base + lo + it * STEP + offs, cache_modifier=CACHE, eviction_policy=EVICT)
            cur, pos = _pair_update(val, cur, pos, it.to(tl.int16))
    else:
        for it in range(0, n_full):
            val = tl.load(base + lo + it * STEP + offs, cache_modifier=CACHE, eviction_policy=EVICT)
            cur, pos = _pair_update(val, cur, pos, it.to(tl.int16))
    if lo + n_full * STEP < hi:  # the slice's partial tile, masked
        idx = lo + n_full * STEP + offs
        val = tl.load(base + idx, mask=idx < hi, other=float("-inf"))
        cur, pos = _pair_update(val, cur, pos, n_full.to(tl.int16))
    return cur, pos, lo, hi, offs


@triton.jit
def _packed_key(cur, pos, lo, hi, offs, STEP: tl.constexpr, SHORT: tl.constexpr):
    """The order key of `_packed_scan`'s slots: the best (value, first index) over them. SHORT (the slice
    spans at most 65536 logits): reduced as one int32 per slot, the 16-bit value's order code above the
    slot's index in the slice, then turned into the int64 key once; else as int64 keys."""
    local = pos.to(tl.int32) * STEP + offs  # index in the slice
    if SHORT:
        bits = cur.to(tl.int16, bitcast=True).to(tl.int32) & 65535
        bits = tl.where(bits == 32768, 0, bits)  # -0.0 ties +0.0, as in torch
        # Sign-magnitude to order: negatives flipped below the positives; every NaN above +inf.
        code = tl.where(cur != cur, 65535, tl.where(bits >= 32768, 65535 - bits, bits + 32768))
        key = tl.where(lo + local < hi, ((code - 32768) << 16) | (65535 - local), -2147483648)  # signed order
        top = tl.max(tl.max(key, axis=1), axis=0)
        code = (top >> 16) + 32768
        bits = tl.where(code >= 32768, code - 32768, 65535 - code)  # the value's 16 bits (one NaN for all)
        val = bits.to(tl.int16).to(cur.dtype, bitcast=True).to(tl.float32)
        out = _order_key(val, lo + 65535 - (top & 65535))
    else:
        out = tl.max(tl.max(tl.where(lo + local < hi, _order_key(cur.to(tl.float32), lo + local),
                                     -9223372036854775807), axis=1), axis=0)
    return out


@triton.jit
def _slice_key_packed(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n,
                      BLOCK_V: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr, SHORT: tl.constexpr):
    """`_slice_key`'s key for 16-bit logits on sm_90, in packed pairs (`_PAIR_ASM`): each of the TILE x
    BLOCK_V slots keeps its max and the chunk it came from; a NaN anywhere redoes the slice exactly."""
    # evict_first: each logit is read once (bench/probe_argmax.py: 0.2-0.4 us less than plain loads at N=64,
    # V=128k on an H200)
    cur, pos, lo, hi, offs = _packed_scan(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, TILE,
                                          STAGES, "", "evict_first")
    key = _packed_key(cur, pos, lo, hi, offs, TILE * BLOCK_V, SHORT)
    # A NaN orders above every number, so the slice saw one iff the best key holds NaN's value bits: one
    # reduction for both. Its position in a packed slot is not the first NaN's: redo the slice exactly.
    if (key >> 32) == 2147483647:
        key = _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, 1, 1)
    return key


@triton.jit
def _slice_key_any(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V: tl.constexpr,
                   UNROLL: tl.constexpr, STAGES: tl.constexpr, TILE: tl.constexpr, PACKED: tl.constexpr,
                   SHORT: tl.constexpr):
    """The key of program (r, s): the packed loop when PACKED (SHORT: chunk <= 65536, see `_packed_key`),
    else the exact one."""
    if PACKED:
        key = _slice_key_packed(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, TILE, STAGES,
                                SHORT)
    else:
        key = _slice_key(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, UNROLL, STAGES)
    return key
