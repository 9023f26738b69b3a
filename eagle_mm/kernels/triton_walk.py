"""Triton tree walk for greedy verification: one program per row, after the argmax (`triton_argmax`).

The argmax left part_key[s, r], one int64 order key per (split s, row-node r); the max over s is the
target's argmax after node r. The walk does what `eagle_mm.decode.tree.greedy_accept` + `path_indices` do, on
register vectors over the row's N+1 nodes (BLOCK lanes). Two ways, same results bit for bit:

  bits (default where it fits, `_walk_bits`): everything that depends on the tree alone is built before
  the argmax's keys are needed (with pdl, while the argmax still runs): each node's ancestors as a
  bitmask and its root path as bytes. After the keys: one load round (the splits' keys), one gather (each
  node's parent's argmax), one reduction (the set of mismatching nodes), one max that gives best, its
  depth and the bonus at once, and best's lane stores its path. For trees of at most 256 nodes and depth
  15 (`bits_fit`).
  jump (`_walk_jump`): accepted flags by pointer jumping (ceil(log2(D+1)) gathers), the deepest by one max,
  the bonus by a sum, the path by D gathers. Any tree the kernel takes (up to 1024 nodes).

Why bits: after the keys each step that needs other lanes' values is a round through shared memory (a
barrier); the jump walk takes ~15 of them, the bits walk 4. On an H200 at N=64, V=128k the walk's part
after gdc_wait takes ~1.1 us against ~1.4 (docs/benchmarks.md, sixth run).
"""
from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without grid dependency control: never called with PDL
    gdc_wait = None

__all__ = ["EMPTY", "KEYS_PLAIN", "KEYS_POLL", "KEYS_SPIN", "KEYS_VOLATILE", "bits_fit", "spin_keys", "walk_consts"]

EMPTY = -9223372036854775807  # below every order key (`triton_argmax._order_key`); an empty key slot (wait="keys")
_EMPTY = tl.constexpr(EMPTY)

# How the walk reads the argmax's keys (its KEYS constexpr):
KEYS_PLAIN = 0  # complete before the walk reads them (stream order, or gdc_wait)
KEYS_VOLATILE = 1  # complete, but written during this launch (the fused kernel): read past L1
KEYS_POLL = 2  # wait="keys": every slot holds EMPTY until its key lands; reload until none does, then empty them
KEYS_SPIN = 3  # KEYS_POLL, but each thread spins on its own slots (`_spin_asm`, never interpreted): KEYS_SPIN,
# KEYS_SPIN + 1 and KEYS_SPIN + 2 wait for 1, 2 and 4 slots at a time (`spin_keys`)


def spin_keys(slots: int, threads: int) -> int:
    """KEYS of the spinning wait for a tile of ``slots`` key slots held by ``threads`` threads: 4 slots per wait
    where each thread holds a multiple of 4 (a wait's slots must divide each thread's), else 2 or 1."""
    per_thread = max(1, slots // threads)
    return KEYS_SPIN + (2 if per_thread % 4 == 0 else 1 if per_thread % 2 == 0 else 0)


def _spin_asm(pack: int, load: str) -> str:
    """PTX that waits for ``pack`` slots at once: lanes whose flag is 0 answer EMPTY; the others load their slot
    (all loads in flight together) and reload the ones still EMPTY until none is. Operands: $0..$pack-1 the
    keys, then the addresses, then the flags. ld.relaxed.gpu reads the L2 (an SM's L1 is not coherent with the
    others'). The label is local to the braces' scope."""
    e = str(EMPTY)
    lines = ["{", ".reg .pred q<%d>, p<%d>, w;" % (pack, pack)]
    for k in range(pack):
        a, f = f"${pack + k}", f"${2 * pack + k}"
        lines += [f"mov.b64 ${k}, {e};", f"setp.ne.s32 q{k}, {f}, 0;", f"@q{k} {load} ${k}, [{a}];"]
    lines.append("WAIT:")
    for k in range(pack):
        lines += [f"setp.eq.s64 p{k}, ${k}, {e};", f"and.pred p{k}, p{k}, q{k};"]
    lines.append("mov.pred w, p0;")
    lines += [f"or.pred w, w, p{k};" for k in range(1, pack)]
    lines.append("@!w bra DONE;")
    lines += [f"@p{k} {load} ${k}, [${pack + k}];" for k in range(pack)]
    lines += ["bra WAIT;", "DONE:", "}"]
    return "\n".join(lines)


# Measured on an H200 at N=64, V=128k (docs/benchmarks.md, eighth run): 4 slots per wait 7.11-7.54 us; one
# slot at a time (each thread's loads one after the other) 7.9-8.3; ld.volatile instead of ld.relaxed.gpu 7.44;
# KEYS_POLL (a block-wide check per round) 7.26-7.77; gdc_wait then one load (wait="grid") 7.77-7.97.
_SPIN1 = tl.constexpr(_spin_asm(1, "ld.relaxed.gpu.global.b64"))
_SPIN2 = tl.constexpr(_spin_asm(2, "ld.relaxed.gpu.global.b64"))
_SPIN4 = tl.constexpr(_spin_asm(4, "ld.relaxed.gpu.global.b64"))


BITS_MAX_BLOCK = 256  # node ids fit a byte of a path row; at most 4 words of 64 bits per node set
BITS_MAX_DEPTH = 15  # a path row of max_depth + 1 bytes in at most 2 words


def bits_fit(block: int, max_depth: int) -> bool:
    """Whether the bits walk takes a tree of BLOCK lanes (>= N+1) and depth max_depth."""
    return block <= BITS_MAX_BLOCK and max_depth <= BITS_MAX_DEPTH


def walk_consts(bits: bool, block: int, max_depth: int) -> dict:
    """`_walk`'s BITS, W (64-bit words per node set) and PW (words per path row, a byte per level);
    the jump walk ignores W and PW."""
    return {"BITS": bits, "W": triton.cdiv(block, 64), "PW": 1 if max_depth < 8 else 2}


@triton.jit
def _argmax_of(key):
    return 2147483647 - (key & 2147483647)  # the index half of an order key


@triton.jit
def _await_keys(ptrs, m, KEYS: tl.constexpr):
    """(S_TILE, BLOCK) int64 keys at ptrs where m, EMPTY elsewhere, once none of them is EMPTY (KEYS_POLL /
    KEYS_SPIN): the argmax may still be storing them (the walk launched early). Then empties them for the
    next call: nobody else reads these slots before this launch ends. A slot that never got a key would
    hang here: every argmax program stores exactly one, into slots that are all EMPTY when the call starts
    (`triton_greedy._key_slots`)."""
    if KEYS >= 3:
        addr = ptrs.to(tl.int64, bitcast=True)
        flag = m.to(tl.int32)
        if KEYS == 3:
            tile = tl.inline_asm_elementwise(_SPIN1, "=l,l,r", [addr, flag], dtype=tl.int64, is_pure=False, pack=1)
        elif KEYS == 4:
            tile = tl.inline_asm_elementwise(_SPIN2, "=l,=l,l,l,r,r", [addr, flag], dtype=tl.int64, is_pure=False,
                                             pack=2)
        else:
            tile = tl.inline_asm_elementwise(_SPIN4, "=l,=l,=l,=l,l,l,l,l,r,r,r,r", [addr, flag], dtype=tl.int64,
                                             is_pure=False, pack=4)
    else:
        tile = tl.load(ptrs, mask=m, other=_EMPTY, volatile=True)
        while tl.max(tl.max((m & (tile == _EMPTY)).to(tl.int32), axis=1), axis=0) != 0:
            tile = tl.load(ptrs, mask=m, other=_EMPTY, volatile=True)
    tl.store(ptrs, tl.full(tile.shape, _EMPTY, tl.int64), mask=m)
    return tile


@triton.jit
def _merged_target(part_key_ptr, rows, live, S, R, BLOCK: tl.constexpr, S_TILE: tl.constexpr,
                   KEYS: tl.constexpr):
    """(BLOCK,) int64: the target's argmax after each node, from the max of its splits' keys part_key[s, r]
    (the order keys compose). S_TILE splits per load, all issued at once, each split's keys contiguous
    over the nodes. KEYS: how to read them (KEYS_PLAIN, KEYS_VOLATILE, KEYS_POLL, KEYS_SPIN; a bool is
    plain or volatile)."""
    s_ids = tl.arange(0, S_TILE)
    key = tl.full((BLOCK,), _EMPTY, tl.int64)
    for s0 in range(0, S, S_TILE):
        ptrs = part_key_ptr + (s0 + s_ids)[:, None].to(tl.int64) * R + rows[None, :]
        m = ((s0 + s_ids) < S)[:, None] & live[None, :]
        if KEYS >= 2:
            tile = _await_keys(ptrs, m, KEYS)
        else:
            tile = tl.load(ptrs, mask=m, other=_EMPTY, volatile=KEYS == 1)  # (S_TILE, BLOCK)
        key = tl.maximum(key, tl.max(tile, axis=0))
    return _argmax_of(key)


@triton.jit
def _accepted(ok, parent, lift_rounds):
    """(BLOCK,) int32 flags: node i and every ancestor matched their parent's choice (ok, int1).
    Pointer jumping: after k rounds flag[i] covers i and its 2**k - 1 nearest ancestors (the root is its
    own parent), so ceil(log2(max_depth + 1)) rounds cover every chain; one gather per round, of
    (ancestor, flag) packed in one int32 (max_depth rounds of one-step gathers cost twice as many)."""
    anc = parent
    flag = ok.to(tl.int32)
    for _round in range(0, lift_rounds):
        packed = tl.gather((anc << 1) | flag, anc, 0)
        flag = flag & packed
        anc = packed >> 1
    return flag


@triton.jit
def _deepest(flag, live, depth, i):
    """(best, accept) int32 scalars: the deepest accepted node, lowest index on ties (torch.argmax order),
    in one max: depth above, 65535 - index below (depth < 2**15, index < 2**16). The root is always
    accepted."""
    top = tl.max(tl.where((flag != 0) & live, (depth << 16) | (65535 - i), -1), axis=0)
    return 65535 - (top & 65535), top >> 16


@triton.jit
def _path(parent, best, accept, i, max_depth, BLOCK: tl.constexpr):
    """(BLOCK,) int32, path_indices: column j holds parent^max(d - j, 0)(best), d = depth[best] = accept;
    j in [0, max_depth]."""
    node = tl.full((BLOCK,), 0, tl.int32) + best
    hops = accept - i  # (BLOCK,) hops still to take in column j = i
    for step in range(0, max_depth):
        node = tl.where(step < hops, tl.gather(parent, node, 0), node)
    return node


@triton.jit
def _bit(node, w: tl.constexpr):
    """(BLOCK,) int64: node's bit in word w of a node set (node % 64 of word node // 64), per lane."""
    return tl.where(node // 64 == w, tl.full(node.shape, 1, tl.int64) << (node % 64).to(tl.int64), 0)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _tree_tables(parent, depth, i, max_depth, W: tl.constexpr, PW: tl.constexpr):
    """From the tree alone, per lane i, all (BLOCK,) int64:
    anc0..anc3: words 0..W-1 of the set of i and its ancestors (bit k of word w: node 64w + k; words past
    W stay 0);
    path0, path1: path_indices' row if best were i, one byte per column (column j in byte j % 8 of word
    j // 8, PW words): i's ancestor at depth j for j < depth[i], else i.
    One gather per level, max_depth levels (the root is its own parent)."""
    anc0, anc1, anc2, anc3 = _bit(i, 0), _bit(i, 1), _bit(i, 2), _bit(i, 3)
    me = i.to(tl.int64)
    path0 = tl.zeros(i.shape, tl.int64)
    path1 = tl.zeros(i.shape, tl.int64)
    for j in tl.static_range(8 * PW):  # columns at or below i's depth hold i
        if j < 8:
            path0 = path0 | tl.where(depth <= j, me << (8 * j), 0)
        else:
            path1 = path1 | tl.where(depth <= j, me << (8 * (j - 8)), 0)
    cur = i
    for h in range(0, max_depth):
        cur = tl.gather(parent, cur, 0)  # i's ancestor h + 1 levels up (the root once past it)
        anc0 = anc0 | _bit(cur, 0)
        if W > 1:
            anc1 = anc1 | _bit(cur, 1)
        if W > 2:
            anc2 = anc2 | _bit(cur, 2)
            anc3 = anc3 | _bit(cur, 3)
        col = depth - 1 - h  # cur's depth: its column in i's row
        up = cur.to(tl.int64)
        path0 = path0 | tl.where((col >= 0) & (col < 8), up << (8 * col).to(tl.int64), 0)
        if PW > 1:
            path1 = path1 | tl.where(col >= 8, up << (8 * (col - 8)).to(tl.int64), 0)
    return anc0, anc1, anc2, anc3, path0, path1


@triton.jit
def _walk_bits(b, part_key_ptr, tokens, parent, depth, i, live,
               target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr, n_nodes, S, R, max_depth,
               BLOCK: tl.constexpr, S_TILE: tl.constexpr, W: tl.constexpr, PW: tl.constexpr,
               WITH_PATH: tl.constexpr, KEYS: tl.constexpr, PDL: tl.constexpr):
    # The tables need only the tree: with PDL they are built while the argmax runs (on an H200 at N=64,
    # V=128k they are done ~3 us before gdc_wait returns: bench/probe_timeline.py). Every per-node value
    # is a (BLOCK,) vector in one layout, so nothing after gdc_wait changes layout (a layout change is a
    # round through shared memory).
    anc0, anc1, anc2, anc3, path0, path1 = _tree_tables(parent, depth, i, max_depth, W, PW)
    if PDL and KEYS < 2:
        gdc_wait()
    return _bits_after_keys(b, part_key_ptr, tokens, parent, depth, i, live, anc0, anc1, anc2, anc3, path0, path1,
                            target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr, n_nodes, S, R, max_depth,
                            BLOCK, S_TILE, W, PW, WITH_PATH, KEYS)


@triton.jit
def _bits_after_keys(b, part_key_ptr, tokens, parent, depth, i, live, anc0, anc1, anc2, anc3, path0, path1,
                     target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr, n_nodes, S, R, max_depth,
                     BLOCK: tl.constexpr, S_TILE: tl.constexpr, W: tl.constexpr, PW: tl.constexpr,
                     WITH_PATH: tl.constexpr, KEYS: tl.constexpr):
    """The bits walk once the keys are there (the tables from `_tree_tables`); returns the best score,
    after which bench/probe_timeline.py reads its clock."""
    rows = b.to(tl.int64) * n_nodes + i  # row-node ids, as the argmax grid numbers them
    target = _merged_target(part_key_ptr, rows, live, S, R, BLOCK, S_TILE, KEYS)  # (BLOCK,) int64 < 2**31
    tl.store(target_ptr + rows, target, mask=live)
    bad = live & (tokens != tl.gather(target.to(tl.int32), parent, 0)) & (i != 0)
    # The set of bad nodes, word by word, in one reduction (the bits are distinct: sum = or); a node is
    # accepted when no node of its root path is bad.
    if W == 1:
        hit = anc0 & tl.sum(tl.where(bad, _bit(i, 0), 0), axis=0)
    if W == 2:
        bad0, bad1 = tl.reduce((tl.where(bad, _bit(i, 0), 0), tl.where(bad, _bit(i, 1), 0)), 0, _add2)
        hit = (anc0 & bad0) | (anc1 & bad1)
    if W == 4:
        bad0, bad1, bad2, bad3 = tl.reduce((tl.where(bad, _bit(i, 0), 0), tl.where(bad, _bit(i, 1), 0),
                                            tl.where(bad, _bit(i, 2), 0), tl.where(bad, _bit(i, 3), 0)), 0, _add4)
        hit = (anc0 & bad0) | (anc1 & bad1) | (anc2 & bad2) | (anc3 & bad3)
    # depth, then 65535 - index, then the bonus (target < 2**31): one max gives all three.
    score = ((((depth << 16) | (65535 - i)).to(tl.int64) << 32) | target)
    top = tl.max(tl.where((hit == 0) & live, score, -1), axis=0)
    best = 65535 - ((top >> 32) & 65535)
    tl.store(accept_ptr + b, top >> 48)
    tl.store(best_ptr + b, best)
    tl.store(bonus_ptr + b, top & 4294967295)
    if WITH_PATH:  # only best's lane stores its row, byte by byte
        row = path_ptr + b.to(tl.int64) * (max_depth + 1) + i * 0
        for j in tl.static_range(8 * PW):
            if j < 8:
                col = (path0 >> (8 * j)) & 255
            else:
                col = (path1 >> (8 * (j - 8))) & 255
            tl.store(row + j, col, mask=(i == best) & (i * 0 + j <= max_depth))  # (a vector mask: interpreter)
    return top


@triton.jit
def _walk_jump(b, part_key_ptr, tokens, parent, depth, i, live,
               target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr, n_nodes, S, R, lift_rounds, max_depth,
               BLOCK: tl.constexpr, S_TILE: tl.constexpr, WITH_PATH: tl.constexpr, KEYS: tl.constexpr,
               PDL: tl.constexpr):
    if PDL and KEYS < 2:
        gdc_wait()
    rows = b.to(tl.int64) * n_nodes + i  # row-node ids, as the argmax grid numbers them
    target = _merged_target(part_key_ptr, rows, live, S, R, BLOCK, S_TILE, KEYS)  # (BLOCK,) int64
    tl.store(target_ptr + rows, target, mask=live)
    target = target.to(tl.int32)  # vocabulary ids < 2**31: int32 halves the gathers and sums below

    # greedy_accept: a node is accepted when it matches its parent's choice and so does every ancestor.
    ok = ((tokens == tl.gather(target, parent, 0)) | (i == 0)) & live
    best, accept = _deepest(_accepted(ok, parent, lift_rounds), live, depth, i)
    bonus = tl.sum(tl.where(i == best, target, 0), axis=0).to(tl.int64)
    tl.store(accept_ptr + b, accept.to(tl.int64))
    tl.store(best_ptr + b, best.to(tl.int64))
    tl.store(bonus_ptr + b, bonus)
    if WITH_PATH:
        node = _path(parent, best, accept, i, max_depth, BLOCK)
        tl.store(path_ptr + b.to(tl.int64) * (max_depth + 1) + i, node.to(tl.int64), mask=i <= max_depth)


@triton.jit
def _walk(b, part_key_ptr, tokens_ptr, parent_ptr, depth_ptr,
          target_ptr, accept_ptr, best_ptr, bonus_ptr, path_ptr,
          n_nodes, S, R, lift_rounds, max_depth, stride_tok, stride_par, stride_dep,
          BLOCK: tl.constexpr, S_TILE: tl.constexpr, WITH_PATH: tl.constexpr, KEYS: tl.constexpr,
          PDL: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, PW: tl.constexpr):
    """Walk row b's tree; every vector is (BLOCK,) >= max(N+1, D+1). The argmax keys are part_key[s, r]
    for split s of row-node r (R = B*(N+1) columns). KEYS: how to read them (`_merged_target`): KEYS_VOLATILE
    for the fused kernel, where other programs wrote them during this launch; KEYS_POLL / KEYS_SPIN
    (wait="keys") waits for each slot to leave EMPTY. PDL: the tree is read (and, with BITS, its tables
    built) while the argmax grid still runs; its keys are read after gdc_wait, or (KEYS_POLL / KEYS_SPIN)
    as they land, and gdc_wait then comes last. BITS: `_walk_bits`
    with W = BLOCK/64 words per node set and PW = (D+1)/8 words per path row; else `_walk_jump`."""
    i = tl.arange(0, BLOCK)
    live = i < n_nodes
    tokens = tl.load(tokens_ptr + b.to(tl.int64) * stride_tok + i, mask=live, other=-1).to(tl.int64)
    # int32 below (it halves the gathers); a token outside [0, 2**31) matches no argmax, and stays so as -1
    tokens = tl.where((tokens >= 0) & (tokens < 2147483648), tokens, -1).to(tl.int32)
    parent = tl.load(parent_ptr + b.to(tl.int64) * stride_par + i, mask=live, other=0).to(tl.int32)
    depth = tl.load(depth_ptr + b.to(tl.int64) * stride_dep + i, mask=live, other=0).to(tl.int32)
    if BITS:
        _walk_bits(b, part_key_ptr, tokens, parent, depth, i, live, target_ptr, accept_ptr, best_ptr, bonus_ptr,
                   path_ptr, n_nodes, S, R, max_depth, BLOCK, S_TILE, W, PW, WITH_PATH, KEYS, PDL)
    else:
        _walk_jump(b, part_key_ptr, tokens, parent, depth, i, live, target_ptr, accept_ptr, best_ptr, bonus_ptr,
                   path_ptr, n_nodes, S, R, lift_rounds, max_depth, BLOCK, S_TILE, WITH_PATH, KEYS, PDL)
    if PDL and KEYS >= 2:  # read as they landed: the walk still ends after the argmax grid, as a stream's order has it
        gdc_wait()
