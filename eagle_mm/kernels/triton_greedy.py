"""Triton greedy tree verification: the argmax over the vocabulary (`triton_argmax`), then the tree walk
(`triton_walk`).

Argmax: `_argmax_partial`, one program per (row-node r, split s), stores the key of its slice at
part_key[s, r]. The memory floor is reading the (B, N+1, V) logits once; the rest is bytes per node.
Walk: one program per row merges the splits (a max over their keys) and finds the accepted path, the
bonus token and the path indices (`triton_walk`: the bits walk for trees that fit, else pointer jumping).

Two ways to run them, same results bit for bit:
  two launches (default): `_argmax_partial`, then `_walk_tree`. On sm_90+ (pdl) the walk is launched
  early (programmatic dependent launch): it reads the tree and builds its tables while the argmax still
  runs, which hides its launch. It then waits (wait="keys", the default with pdl) on the key slots
  themselves: they are kept between calls (`_key_slots`, per device and stream) and hold EMPTY between
  calls; each argmax program stores its key with one strong store, each walk thread spins on its slots
  and empties them once read, and gdc_wait comes last. wait="grid": gdc_wait, then one load of the keys.
  one launch (fused=True): `_argmax_walk`; each program stores its key and takes a ticket from its row's
  counter; the program that takes the row's last ticket walks that row and resets the counter to 0.
  Measured on an H200 it is no faster than two launches (docs/benchmarks.md).

Nothing here reads device memory back to the host.
"""
from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: the walk is never launched early (pdl)
    gdc_launch_dependents = gdc_wait = None

from .triton_argmax import _slice_key_any, short_key
from .triton_walk import (BITS_MAX_BLOCK, BITS_MAX_DEPTH, EMPTY, KEYS_PLAIN, KEYS_POLL, _walk, bits_fit, spin_keys,
                          walk_consts)

__all__ = ["verify_greedy_triton"]

log = logging.getLogger(__name__)


# The key as one relaxed gpu-scope store from thread 0: a strong store, since the walk may be loading that slot
# meanwhile (with a plain, weak store that would be a data race in the PTX memory model). An atomic exchange
# would do too, but returns a value nobody needs.
_STORE_ASM = tl.constexpr("""{
.reg .pred p;
.reg .b32 t;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
@p st.relaxed.gpu.global.b64 [$1], $2;
mov.u32 $0, 0;
}""")


@triton.jit
def _argmax_partial(logits_ptr, part_key_ptr, n_nodes, V, chunk, stride_b, stride_n, R,
                    BLOCK_V: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr, TILE: tl.constexpr,
                    PACKED: tl.constexpr, PDL: tl.constexpr, SHORT: tl.constexpr, SIGNAL: tl.constexpr):
    # grid (R = B * (N+1), S): program (row-node r, split s) -> part_key[s, r]. SIGNAL (wait="keys"): the walk
    # may be polling that slot, so the key goes in as a strong store (`_STORE_ASM`).
    if PDL:  # the walk may launch now; it waits (gdc_wait) for this whole grid before reading a key
        gdc_launch_dependents()
    r = tl.program_id(0)
    s = tl.program_id(1)
    key = _slice_key_any(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, UNROLL, STAGES, TILE, PACKED,
                         SHORT)
    slot = part_key_ptr + s.to(tl.int64) * R + r
    if SIGNAL:
        tl.inline_asm_elementwise(_STORE_ASM, "=r,l,l", [slot.to(tl.int64, bitcast=True), key], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.store(slot, key)


@triton.jit
def _walk_tree(part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
               target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
               n_nodes, S, R, lift_rounds, max_depth, stride_tok, stride_par, stride_dep,
               BLOCK: tl.constexpr, S_TILE: tl.constexpr, WITH_PATH: tl.constexpr, PDL: tl.constexpr,
               BITS: tl.constexpr, W: tl.constexpr, PW: tl.constexpr, KEYS: tl.constexpr):
    # grid (B,): one program walks one row's tree; the keys come from the previous launch (with PDL that
    # launch may still run: _walk waits for it, or for each key, before reading a key).
    _walk(tl.program_id(0), part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
          target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
          n_nodes, S, R, lift_rounds, max_depth, stride_tok, stride_par, stride_dep, BLOCK, S_TILE, WITH_PATH,
          KEYS, PDL, BITS, W, PW)


@triton.jit
def _argmax_walk(logits_ptr, part_key_ptr, count_ptr, tokens_ptr, parent_ptr, depth_ptr,
                 target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
                 n_nodes, V, chunk, stride_b, stride_n, S, R, lift_rounds, max_depth, stride_tok, stride_par,
                 stride_dep,
                 BLOCK_V: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr, TILE: tl.constexpr,
                 PACKED: tl.constexpr, BLOCK: tl.constexpr, S_TILE: tl.constexpr, WITH_PATH: tl.constexpr,
                 BITS: tl.constexpr, W: tl.constexpr, PW: tl.constexpr, SHORT: tl.constexpr):
    # grid (B * (N+1), S), as _argmax_partial; count_ptr: (>= B,) int32, all 0 on entry and on exit.
    r = tl.program_id(0)
    s = tl.program_id(1)
    key = _slice_key_any(logits_ptr, r, s, n_nodes, V, chunk, stride_b, stride_n, BLOCK_V, UNROLL, STAGES, TILE, PACKED,
                         SHORT)
    tl.store(part_key_ptr + s.to(tl.int64) * R + r, key)
    # The key store and the atomic may be issued by different threads: the barrier orders them inside
    # the CTA, and the atomic's release (cumulative in the PTX model) then publishes the key GPU-wide.
    tl.debug_barrier()
    b = r // n_nodes
    ticket = tl.atomic_add(count_ptr + b, 1, sem="acq_rel", scope="gpu")
    # No program ever waits, so this cannot deadlock however many programs are resident. The last
    # ticket's acquire makes every other program's key of row b visible to the walk that follows;
    # the walk reads them volatile so that no line cached in L1 earlier in this launch is reused.
    if ticket == n_nodes * S - 1:
        _walk(b, part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
              target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
              n_nodes, S, R, lift_rounds, max_depth, stride_tok, stride_par, stride_dep, BLOCK, S_TILE, WITH_PATH,
              1, False, BITS, W, PW)  # KEYS_VOLATILE
        # Every ticket of row b is taken, so nobody else touches it in this launch: ready for the next
        # call (and for CUDA-graph replay, which never re-zeroes it).
        tl.store(count_ptr + b, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _pick_splits(rows: int, V: int, block_v: int, device: torch.device, programs_per_sm: int) -> int:
    """Splits so that the grid fills every SM at most ``programs_per_sm`` times; never more than chunks."""
    if device.type != "cuda":
        return 1
    index = _index(device)
    # Rounded down: one program more per SM than the others on some SMs costs a whole slice of time
    # (measured on an H200: 7.16 -> 6.82 us for the argmax alone at N=64, V=128k).
    want = programs_per_sm * _sm_count(index) // rows
    return max(1, min(want, -(-V // block_v), 64))


def _split_grid(rows: int, V: int, block_v: int, device: torch.device, programs_per_sm: int,
                splits: int | None = None) -> tuple[int, int]:
    """(splits, chunk): each split covers whole BLOCK_V chunks, and none starts past V."""
    S = splits or _pick_splits(rows, V, block_v, device, programs_per_sm)
    chunk = triton.cdiv(triton.cdiv(V, S), block_v) * block_v
    return triton.cdiv(V, chunk), chunk


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _hopper(device: torch.device) -> bool:
    """sm_90 or newer: the packed-pair asm and programmatic dependent launch (griddepcontrol) need it."""
    return device.type == "cuda" and _sm90(_index(device))


def _can_pdl(device: torch.device) -> bool:
    return gdc_wait is not None and _hopper(device)


def _can_pack(logits: torch.Tensor) -> bool:
    """The packed-pair argmax (`_PAIR_ASM`) runs on fp16/bf16 logits on sm_90 or newer, never interpreted."""
    return logits.dtype in (torch.float16, torch.bfloat16) and _hopper(logits.device)


# The packed argmax's tiling where the caller gives none: the best of a sweep of bench/bench_verify.py
# --variant tilings on an H200 at N=64, V=128k (docs/benchmarks.md, sixth run). The exact loop keeps its own.
_PACKED_TILING = {"block_v": 2048, "num_warps": 16, "programs_per_sm": 2}


_MERGE_TILE = 8192  # int64 keys per merge load in the walk (tests shrink it to run several tiles)

_RETIRED: list[torch.Tensor] = []  # outgrown kept buffers: a captured CUDA graph may still use them


def _filled(n: int, minimum: int, fill: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new buffer of at least n and ``minimum`` fill values, a power of two (so that it rarely grows)."""
    return torch.full((max(minimum, triton.next_power_of_2(n)),), fill, dtype=dtype, device=device)


def _kept(cache: dict, key, n: int, device: torch.device, fill: int, dtype: torch.dtype,
          minimum: int) -> torch.Tensor | None:
    """cache[key] if it holds >= n elements; else a new `_filled` buffer, kept there in its place. None inside a
    CUDA-graph capture: a new buffer's fill would only run at replay, so eager calls would find it unfilled;
    the caller decides."""
    buf = cache.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = cache[key] = _filled(n, minimum, fill, dtype, device)
    return buf


# Fused-kernel ticket counters, one int32 per batch row, per device. Zeroed once when allocated (a
# per-call torch.zeros would cost a memset launch); each call's walkers put them back to 0. One buffer
# per device: fused calls on one device must not run concurrently on different streams.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _row_counters(device: torch.device, B: int) -> torch.Tensor:
    buf = _kept(_COUNTERS, device, B, device, 0, torch.int32, 64)
    if buf is None:
        raise RuntimeError(f"fused verify: call it once with B >= {B} before CUDA-graph capture, so "
                           "its counter buffer exists")
    return buf


# wait="keys": key slots kept between calls, every one EMPTY between calls (each walk empties the slots it
# has read), one buffer per (device, stream): calls on one stream run in order, so no two share a slot at
# once. Filled once when allocated; a captured CUDA graph keeps using its capture stream's buffer.
_KEY_SLOTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _key_slots(device: torch.device, n: int) -> torch.Tensor:
    """(>= n,) int64 slots, all EMPTY, for a wait="keys" call on the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buf = _kept(_KEY_SLOTS, (device, stream), n, device, EMPTY, torch.int64, 4096)
    if buf is None:
        # Filled inside the capture: the fill runs at each replay, before the kernels, so the graph is right;
        # not kept, since an eager call would find it unfilled.
        buf = _filled(n, 4096, EMPTY, torch.int64, device)
        log.warning("verify_greedy_triton(wait='keys') captured without an earlier call of at least this size "
                    "on the capture stream: the graph fills its %d key slots at each replay (a memset). Call it "
                    "once on that stream before capture to avoid it.", buf.numel())
    return buf


def verify_greedy_triton(logits: torch.Tensor, tree_tokens: torch.Tensor, parent: torch.Tensor,
                         depth: torch.Tensor, max_depth: int, *, with_path: bool = False,
                         splits: int | None = None, block_v: int | None = None, num_warps: int | None = None,
                         programs_per_sm: int | None = None, fused: bool = False, unroll: int = 1, stages: int = 1,
                         walk_warps: int | None = None, tile: int = 1, pdl: bool | None = None,
                         packed: bool | None = None, walk: str | None = None, wait: str | None = None):
    """Triton greedy verification; see `eagle_mm.kernels.dispatch.verify_greedy` for the contract.

    Returns (accept_len, best, bonus, path or None, target) with target (B, N+1) the per-node argmax.
    ``packed`` (None = fp16/bf16 on sm_90+) picks the packed-pair argmax, ``pdl`` (None = sm_90+ with two
    launches) the early-launched walk; the defaults come from bench/bench_verify.py --tilings on an H200.
    ``splits`` / ``block_v`` / ``num_warps`` / ``programs_per_sm`` tune the argmax grid, ``tile`` the packed
    loop (chunks per load), ``unroll`` / ``stages`` the exact one; ``fused``: one launch instead of two;
    ``walk`` "bits" or "jump" (None = bits where `triton_walk.bits_fit`), ``walk_warps`` its warps;
    ``wait`` (two launches) "grid": the walk reads the keys once the argmax grid is done (gdc_wait with pdl),
    or "keys": each key slot is EMPTY until its key lands and the walk polls the slots themselves, then
    empties them (slots kept per device and stream, `_key_slots`); None = "keys" with pdl, else "grid".
    Every option gives the same results bit for bit (tests/test_kernels.py, run on an H200 and under the
    interpreter); none reads the device back.
    """
    B, n_nodes, V = logits.shape
    if max(n_nodes, max_depth + 1) > 1024:
        raise ValueError(f"the walk holds at most 1024 nodes per row, got max(N+1, max_depth+1) = "
                         f"{max(n_nodes, max_depth + 1)}")
    if unroll not in (1, 2):
        raise ValueError(f"unroll must be 1 or 2, got {unroll!r}")
    if not isinstance(stages, int) or not 1 <= stages <= 8:
        raise ValueError(f"stages must be an int in [1, 8], got {stages!r}")
    block = triton.next_power_of_2(max(n_nodes, max_depth + 1))
    if walk is None:
        walk = "bits" if bits_fit(block, max_depth) else "jump"
    if walk not in ("bits", "jump"):
        raise ValueError(f"walk must be 'bits', 'jump' or None, got {walk!r}")
    if walk == "bits" and not bits_fit(block, max_depth):
        raise ValueError(f"walk='bits' takes at most {BITS_MAX_BLOCK} lanes (N+1 <= 256) and max_depth <= "
                         f"{BITS_MAX_DEPTH}, got {block} lanes (N+1 = {n_nodes}) and max_depth = {max_depth}")
    if tile not in (1, 2, 4, 8):
        raise ValueError(f"tile must be 1, 2, 4 or 8 chunks per load (packed argmax), got {tile!r}")
    if packed is None:  # a caller's chunk too small for pairs picks the exact loop
        packed = _can_pack(logits) and (block_v is None or block_v * tile >= 64)
    pdl = _can_pdl(logits.device) and not fused if pdl is None else pdl
    if wait is None:
        wait = "keys" if pdl else "grid"
    if wait not in ("grid", "keys"):
        raise ValueError(f"wait must be 'grid', 'keys' or None, got {wait!r}")
    if wait == "keys" and fused:
        raise ValueError("wait='keys' is for the two-launch kernel; fused=True waits with its row counters")
    if packed and not _can_pack(logits):
        raise ValueError(f"packed needs fp16/bf16 logits on a CUDA GPU of compute capability >= 9.0, got "
                         f"{logits.dtype} on {logits.device}")
    if pdl and (fused or not _can_pdl(logits.device)):
        raise ValueError("pdl (programmatic dependent launch of the walk) needs the two-launch kernel on a CUDA GPU "
                         f"of compute capability >= 9.0 and a Triton with gdc_wait, got fused={fused}, device "
                         f"{logits.device}")
    if packed:
        if block_v is not None and block_v * tile < 64:  # pairs of one thread's registers, 32 threads a warp
            raise ValueError(f"packed needs block_v * tile >= 64, got block_v={block_v}, tile={tile}")
        block_v = block_v or _PACKED_TILING["block_v"]
        num_warps = num_warps or _PACKED_TILING["num_warps"]
        programs_per_sm = programs_per_sm or _PACKED_TILING["programs_per_sm"]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tree_tokens, parent, depth = (t if t.stride(-1) == 1 else t.contiguous() for t in (tree_tokens, parent, depth))
    block_v = block_v or min(2048, triton.next_power_of_2(V))
    num_warps = num_warps or (8 if block_v >= 2048 else 4)
    if packed:
        num_warps = max(1, min(num_warps, block_v * tile // 64))
    S, chunk = _split_grid(B * n_nodes, V, block_v, logits.device, programs_per_sm or 4, splits)
    if packed and triton.cdiv(chunk, block_v * tile) >= 2**15:  # the packed loop counts chunks in int16
        raise ValueError(f"packed: {triton.cdiv(chunk, block_v * tile)} chunks per split is over 32767; "
                         "raise block_v, tile or splits")

    # One allocation (host time counts at these sizes), cut into contiguous int64 pieces.
    keys = wait == "keys"
    sizes = (0 if keys else B * n_nodes * S, B * n_nodes, B, B, B, B * (max_depth + 1) if with_path else 0)
    buf = torch.empty(sum(sizes), dtype=torch.int64, device=logits.device)
    part_key, target, accept, best, bonus, path = torch.split(buf, sizes)  # part_key: (S, B*(N+1)) keys
    if keys:
        part_key = _key_slots(logits.device, B * n_nodes * S)
    target, path = target.view(B, n_nodes), path.view(B, -1)
    s_tile = min(triton.next_power_of_2(S), max(1, _MERGE_TILE // block))  # (s_tile, block) keys per load
    outputs = (target, accept, best, bonus, path if with_path else best)  # a dummy path when unused
    # R columns of keys per split; ceil(log2(max_depth + 1)) pointer-jumping rounds cover every chain.
    walk_args = (n_nodes, S, B * n_nodes, max_depth.bit_length(), max_depth, tree_tokens.stride(0),
                 parent.stride(0), depth.stride(0))
    short = short_key(packed, chunk)
    bits = walk_consts(walk == "bits", block, max_depth)
    if fused:
        # The walk runs in the argmax's warps; it is only ~N+1 lanes of work, on one program per row.
        _argmax_walk[(B * n_nodes, S)](logits, part_key, _row_counters(logits.device, B), tree_tokens, parent,
                                       depth, *outputs, n_nodes, V, chunk, logits.stride(0), logits.stride(1),
                                       *walk_args[1:], BLOCK_V=block_v, UNROLL=unroll, STAGES=stages, TILE=tile,
                                       PACKED=packed, BLOCK=block, S_TILE=s_tile, WITH_PATH=with_path,
                                       SHORT=short, num_warps=num_warps, **bits)
    else:
        _argmax_partial[(B * n_nodes, S)](logits, part_key, n_nodes, V, chunk, logits.stride(0), logits.stride(1),
                                          B * n_nodes, BLOCK_V=block_v, UNROLL=unroll, STAGES=stages, TILE=tile,
                                          PACKED=packed, PDL=pdl, SHORT=short, SIGNAL=keys and pdl, num_warps=num_warps)
        launch = {"launch_pdl": True} if pdl else {}  # the interpreter knows no such option
        warps = walk_warps or (4 if block <= 256 else 8)
        # With pdl the walk may wait while the argmax runs: each thread spins on its slots (sm_90). Else the keys
        # are all there when it starts, and one round of KEYS_POLL finds them (the interpreter runs that).
        read = (spin_keys(s_tile * block, 32 * warps) if pdl else KEYS_POLL) if keys else KEYS_PLAIN
        _walk_tree[(B,)](part_key, tree_tokens, parent, depth, *outputs, *walk_args,
                         BLOCK=block, S_TILE=s_tile, WITH_PATH=with_path, PDL=pdl, KEYS=read,
                         num_warps=warps, **bits, **launch)
    return accept, best, bonus, (path if with_path else None), target
