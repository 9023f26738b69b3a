"""The draft side of a decode cycle: extending the head's own KV cache and growing the EAGLE-2 tree.

The head's entry at position t pairs the target feature at t with the token at t+1 and predicts the
token at t+2. Its KV cache (``HeadCache``) holds one entry per committed target slot, with ``pos`` (B, C) = -1
for padding/holes, exactly like the target's slots, then the scratch slots one draft writes.

Greedy mode expands each node's top-k children by draft log-prob. Sampling mode draws each node's
children without replacement from the (warped) draft distribution q and keeps q for verification,
which accepts them by recursive rejection sampling (``sampling.py``); sibling scores are made
non-increasing in sample order so the global rerank keeps a prefix of every node's samples.

The proposal q may be any distribution, as long as the verifier gets the one the children were drawn from
(``sampling.py`` says why). With transformers' temperature, top-k, top-p and min-p warpers (what ``generate``
builds from its sampling options), q lives on the draft's W most likely tokens (``DraftSampler.width``): one top-W
per node, then the warpers' rules on W sorted values, instead of the warpers on the whole vocabulary (a sort for
top-p, a top-k, a scatter to the target's ids: about 200 us of kernels per draft level on the H200, for code-tiny's
8,192 tokens). Other warpers run as transformers writes them, on the whole vocabulary (W = its size).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from ..config import TreeConfig
from ..hf.generation import SORTED_RULES, top_k_of
from .processors import apply_input_free, reads_input_ids
from .sampling import draft_noise, sample_children, sibling_scores
from .tree import Tree, select_tree

__all__ = ["HeadCache", "DraftSampler", "Candidates", "head_cache", "head_entries", "draft_candidates",
           "draft_tree", "node_q", "scratch_slots", "with_scratch"]


@dataclass
class HeadCache:
    """The head's KV cache at fixed shapes: C committed slots, then ``scratch`` slots reserved for the draft steps of
    one cycle, so that every head step sees the same shapes (what lets it be captured and compiled once)."""

    k: torch.Tensor  # (B, nkv, C + scratch, hd)
    v: torch.Tensor  # (B, nkv, C + scratch, hd_v)
    pos: torch.Tensor  # (B, C) position of each committed slot, -1 if unused
    scratch: int = 0  # draft slots after the C committed ones


DRAFT_WIDTH = 64  # tokens a node's proposal keeps when no top-k warper is set (the draft's tail is rarely accepted)


@dataclass
class DraftSampler:
    """Turns draft logits into the proposal distribution q: W candidate target ids per node and their log q."""

    warpers: object  # the input-free part of generate()'s processors (temperature, top-k/p, ...)
    target_ids: torch.Tensor  # (V_draft,) target id of each draft id
    vocab_size: int
    generator: torch.Generator | None
    width: int  # W: candidates per node (the whole target vocabulary when not ``compact``)
    compact: bool  # q on the draft's top-W tokens, with the warpers' rules applied there

    @classmethod
    def from_processors(cls, processors, head, generator, min_width: int = 1) -> "DraftSampler":
        """``min_width``: the tree's top_k (each node draws that many children)."""
        from transformers import LogitsProcessorList

        warpers = LogitsProcessorList([p for p in (processors or []) if not reads_input_ids([p])])
        vd = head.config.draft_vocab_size if hasattr(head.config, "draft_vocab_size") else head.config.vocab_size
        ids = head.draft_to_target(torch.arange(vd, device=next(head.parameters()).device))
        V = head.config.vocab_size
        if not all(type(p) in SORTED_RULES for p in warpers):
            return cls(warpers, ids, V, generator, V, False)
        top = top_k_of(warpers)
        top = DRAFT_WIDTH if top is None else top
        return cls(warpers, ids, V, generator, min(vd, max(min_width, top)), True)

    def settings(self) -> tuple:
        """What the sampler does, hashable: its width and each warper's type and attributes (tensors by value). The
        decoder keeps one generator-less sampler per settings, which its captured draft step is keyed on."""
        warpers = ((type(p), tuple(sorted((k, _plain(v)) for k, v in vars(p).items()))) for p in self.warpers)
        return (self.width, self.compact, *warpers)

    def proposal(self, draft_logits: torch.Tensor):
        """(B, M, V_draft) draft logits -> (cand (B, M, W) target ids, logq (B, M, W) log q there, -inf = 0)."""
        if not self.compact:
            B, M, _ = draft_logits.shape
            cand = torch.arange(self.vocab_size, device=draft_logits.device).expand(B, M, -1)
            return cand, self.logq(draft_logits)
        values, idx = draft_logits.float().topk(self.width, dim=-1)  # sorted, largest first
        for p in self.warpers:
            values = SORTED_RULES[type(p)](p, values)
        return self.target_ids[idx], torch.log_softmax(values, dim=-1)

    def logq(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(B, M, V_draft) draft logits -> (B, M, V) log q over target ids (-inf outside the draft vocab)."""
        B, M, vd = draft_logits.shape
        full = draft_logits.new_full((B, M, self.vocab_size), float("-inf"))
        full[..., self.target_ids] = draft_logits.float()
        if self.warpers:
            full = apply_input_free(self.warpers, full.view(B * M, -1)).view(B, M, -1)
        return torch.log_softmax(full, dim=-1)


def _plain(value):
    """A hashable stand-in for a warper attribute (tensors by their values)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.flatten().tolist()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """(B, Q, K) bool -> (B, 1, Q, K) additive float mask."""
    m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return m.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def head_cache(head, hidden: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
               embeds: torch.Tensor | None = None, *, scratch: int = 0, step=None):
    """The head's cache over a sequence of committed entries (what the decode loop's prefill builds), with
    ``scratch`` draft slots after them.

    hidden (B, A, F) target features; tokens (B, A) the next tokens; pos (B, A) positions, -1 = padding. Returns
    (cache, out (B, A, H), logits (B, A, V_draft)). ``step``: the head's step function (default ``head.step``).
    """
    out, logits, (k, v) = head_entries(head, None, hidden, tokens, pos, embeds, step=step)
    return with_scratch(HeadCache(k, v, pos), scratch), out, logits


def head_entries(head, cache: HeadCache | None, hidden: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                 embeds: torch.Tensor | None = None, *, step=None):
    """The head's step over A new entries attending to its cache (None: to each other only), which is not modified.

    hidden (B, A, F), tokens (B, A), pos (B, A) as in ``head_cache``. Returns (out (B, A, H), logits
    (B, A, V_draft), (k, v) (B, nkv, A, hd)): the caller writes k, v where the entries belong.
    """
    B, A = pos.shape
    dtype = next(head.parameters()).dtype
    h = head.fuse(hidden)
    e = head.embed(tokens) if embeds is None else embeds.to(h.dtype)
    q = pos[:, :, None]
    causal = (pos[:, None, :] <= q) & (pos >= 0)[:, None, :]  # (B, A, A)
    if cache is None:
        allowed, past = causal, None
    else:
        old = (cache.pos[:, None, :] >= 0) & (cache.pos[:, None, :] <= q)  # (B, A, C)
        # The scratch slots between the committed ones and the new entries hold draft leftovers.
        gap = torch.zeros(B, A, cache.scratch, dtype=torch.bool, device=pos.device)
        allowed, past = torch.cat((old, gap, causal), dim=-1), (cache.k, cache.v)
    return (step or head.step)(e, h, pos.clamp(min=0), _additive(allowed, dtype), past)


def _children(head, logits: torch.Tensor, parent_score: torch.Tensor, parent_logp: torch.Tensor, k: int,
              sampler: DraftSampler | None, noise: torch.Tensor | None):
    """Children of each of M nodes: tokens (B, M, k) target ids, rank scores (B, M, k), path log-probs
    (B, M, k), and in sampling mode q as (cand (B, M, W) target ids, q (B, M, W)) (else None). ``noise`` (B, M, W):
    the Exp(1) draws (sampling)."""
    if sampler is None:
        logp, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
        path = parent_logp[..., None] + logp
        return head.draft_to_target(ids), path, path, None
    cand, logq = sampler.proposal(logits)  # (B, M, W) each
    at, _ = sample_children(logq, k, sampler.generator, noise)  # (B, M, k) places in cand, in sample order
    child_logq = logq.gather(-1, at)
    # Invalid draws (q = 0, after q's support) already score -inf in sibling_scores.
    scores = sibling_scores(parent_score, parent_logp, child_logq)
    return cand.gather(-1, at), scores, parent_logp[..., None] + child_logq, (cand, logq.exp())


@dataclass
class Candidates:
    """Every node a draft proposed, in creation order (parents first), before the global rerank."""

    tokens: torch.Tensor  # (B, M) target ids
    parent: torch.Tensor  # (B, M) candidate index of the parent, -1 = the root
    depth: torch.Tensor  # (M,) 1 for the root's children
    score: torch.Tensor  # (B, M) rank score (greedy: cumulative draft log-prob)
    q_rows: list  # sampling: (cand, q) of each expanded node, the root's (B, W) each first, then (B, k, W) per level
    expanded: list  # sampling mode: candidate ids of the nodes each q row belongs to


def scratch_slots(top_k: int, depth: int) -> int:
    """Head-cache slots one draft writes: top_k per level below the first."""
    return (depth - 1) * top_k


def with_scratch(cache: HeadCache, scratch: int) -> HeadCache:
    """The cache's committed slots, copied into a cache with ``scratch`` draft slots after them (the same cache when
    it has that many)."""
    if cache.scratch == scratch:
        return cache
    C = cache.pos.shape[1]
    k, v = cache.k[:, :, :C], cache.v[:, :, :C]
    k = torch.cat((k, k.new_zeros(*k.shape[:2], scratch, k.shape[3])), 2)
    v = torch.cat((v, v.new_zeros(*v.shape[:2], scratch, v.shape[3])), 2)
    return HeadCache(k, v, cache.pos, scratch)


def draft_candidates(head, cache: HeadCache, root_out: torch.Tensor, root_logits: torch.Tensor,
                     root_pos: torch.Tensor, top_k: int, depth: int,
                     sampler: DraftSampler | None = None, noise: torch.Tensor | None = None, *,
                     step=None) -> Candidates:
    """Grow the EAGLE-2 frontier ``depth`` levels deep below the root at ``root_pos`` (B,).

    ``cache``: the head's C committed entries followed by at least ``scratch_slots(top_k, depth)`` scratch slots,
    which the draft writes (one fixed shape for every step).
    root_out (B, H) / root_logits (B, V_draft): the head's output at the entry that pairs the feature
    before the root with the root. ``noise`` (B, 1 + (depth-1)*top_k, W): the sampled draft's Exp(1) draws
    (``sampling.draft_noise``); None draws them here. ``step``: the head's step function (default ``head.step``).
    """
    step = step or head.step
    if cache.scratch < (depth - 1) * top_k:  # scratch_slots(top_k, depth)
        raise ValueError(f"head cache has {cache.scratch} scratch slots, a depth-{depth} top-{top_k} draft "
                         f"needs {scratch_slots(top_k, depth)}")
    B, k, dev = root_out.shape[0], top_k, root_out.device
    dtype = next(head.parameters()).dtype
    if sampler is not None and noise is None:
        noise = draft_noise(torch.empty(B, 1 + scratch_slots(k, depth), sampler.width, device=dev),
                            sampler.generator)
    zero = torch.zeros(B, 1, device=dev)
    tok, score, logp, q = _children(head, root_logits[:, None], zero, zero, k, sampler,
                                    None if noise is None else noise[:, :1])
    tok, score, logp = tok[:, 0], score[:, 0], logp[:, 0]  # (B, k) the depth-1 candidates
    cand_tok, cand_score, cand_parent = [tok], [score], [torch.full_like(tok, -1)]
    cand_depth = [torch.ones(k, dtype=torch.long, device=dev)]
    q_rows = [(q[0][:, 0], q[1][:, 0])] if q is not None else []  # (cand, q) of each expanded node, root first
    expanded = [torch.full((B, 1), -1, dtype=torch.long, device=dev)]  # candidate id of each q row
    front_idx = torch.arange(k, device=dev).expand(B, k)  # candidate ids of the frontier
    # Row-major strides like the later frontiers': one compiled step for all. (contiguous() is not enough: with
    # size-1 dims it keeps the root's prompt-length stride, and dynamo guards on strides.)
    front_hidden = root_out[:, None, :].expand(B, k, root_out.shape[-1]).clone(memory_format=torch.contiguous_format)
    front_anc = torch.zeros(B, k, cache.scratch, dtype=torch.bool, device=dev)  # ancestry over the scratch slots
    n_cand = k
    past_ok = cache.pos >= 0  # (B, C)
    eye = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)
    s_base = cache.pos.shape[1]  # the scratch slots start after the C committed ones
    for d in range(1, depth):
        # Run the head on the frontier (depth-d nodes) to propose depth d+1; unwritten scratch slots are masked.
        pos = (root_pos + d - 1)[:, None].expand(B, k)  # a depth-d node pairs with the feature at depth d-1
        allowed = torch.cat((past_ok[:, None, :].expand(B, k, -1), front_anc, eye), dim=-1)
        out, logits, (k_new, v_new) = step(head.embed(tok), front_hidden, pos, _additive(allowed, dtype),
                                           (cache.k, cache.v))
        s0 = s_base + (d - 1) * k  # this step's scratch slots
        cache.k[:, :, s0:s0 + k], cache.v[:, :, s0:s0 + k] = k_new, v_new
        rows = None if noise is None else noise[:, 1 + (d - 1) * k: 1 + d * k]
        child_tok, child_score, child_logp, q = _children(head, logits, score, logp, k, sampler, rows)  # (B, k, k)
        if q is not None:
            q_rows.append(q)  # (B, k, W) each, one row per frontier node
            expanded.append(front_idx)
        cand_tok.append(child_tok.flatten(1))
        cand_score.append(child_score.flatten(1))
        cand_parent.append(front_idx[:, :, None].expand(B, k, k).flatten(1))
        cand_depth.append(torch.full((k * k,), d + 1, dtype=torch.long, device=dev))
        # The next frontier: the k best children overall; a stable sort breaks ties by creation order,
        # which sampling mode's exactness argument relies on (see sampling.py).
        pick = torch.sort(child_score.flatten(1), dim=-1, descending=True, stable=True).indices[:, :k]  # (B, k)
        score, logp = child_score.flatten(1).gather(1, pick), child_logp.flatten(1).gather(1, pick)
        par = torch.div(pick, k, rounding_mode="floor")  # frontier slot of each pick's parent
        tok = cand_tok[-1].gather(1, pick)
        front_idx = n_cand + pick
        n_cand += k * k
        front_hidden = out.gather(1, par[:, :, None].expand(-1, -1, out.shape[-1]))
        front_anc = front_anc.gather(1, par[:, :, None].expand(-1, -1, front_anc.shape[2]))
        own = torch.zeros_like(front_anc)
        own.scatter_(2, ((d - 1) * k + par)[:, :, None], True)  # each pick's parent's scratch slot
        front_anc = front_anc | own
    return Candidates(torch.cat(cand_tok, 1), torch.cat(cand_parent, 1), torch.cat(cand_depth),
                      torch.cat(cand_score, 1), q_rows, expanded)


def draft_tree(head, cache: HeadCache, root: torch.Tensor, root_out: torch.Tensor, root_logits: torch.Tensor,
               root_pos: torch.Tensor, tree: TreeConfig, sampler: DraftSampler | None = None,
               noise: torch.Tensor | None = None, *, step=None):
    """Grow a tree below ``root`` (B,): the candidates, then the global rerank.

    ``cache``: the head's cache (``head_cache``; copied with the draft's scratch slots where it has fewer). Returns
    (Tree, q) where q (B, N+1, V) is the proposal distribution each node's children were drawn from (sampling mode;
    zeros for nodes never expanded), or None in greedy mode.
    """
    need = scratch_slots(tree.top_k, tree.depth)
    if cache.scratch < need:
        cache = with_scratch(cache, need)
    c = draft_candidates(head, cache, root_out, root_logits, root_pos, tree.top_k, tree.depth, sampler, noise,
                         step=step)
    result = select_tree(root, c.tokens, c.parent, c.depth, c.score, tree.total_tokens)
    if sampler is None:
        return result, None
    q = torch.empty(*result.tokens.shape, sampler.vocab_size, device=result.tokens.device)
    return result, node_q(result, c.q_rows, c.expanded, c.tokens.shape[1], q)


def node_q(tree: Tree, q_rows: list, expanded: list, n_cand: int, out: torch.Tensor) -> torch.Tensor:
    """The proposal distribution of each tree node, written into ``out`` (B, N+1, V) (zeros for a node never
    expanded) from the expanded nodes' (cand, q) rows (``Candidates.q_rows``). Returns ``out``."""
    cand = torch.cat([q_rows[0][0][:, None]] + [c for c, _ in q_rows[1:]], dim=1)  # (B, E, W) one row per expanded
    q = torch.cat([q_rows[0][1][:, None]] + [p for _, p in q_rows[1:]], dim=1)  # node, the root's first
    # A last row for "not expanded": q = 0 written at token 0, which leaves its row of ``out`` all zeros.
    cand, q = torch.cat((cand, torch.zeros_like(cand[:, :1])), 1), torch.cat((q, torch.zeros_like(q[:, :1])), 1)
    B, E = q.shape[0], q.shape[1] - 1
    slot = torch.full((B, n_cand + 1), E, dtype=torch.long, device=q.device)  # cand id + 1 -> q row
    ids = torch.cat(expanded, dim=1) + 1  # (B, E): root is candidate -1 -> 0
    slot.scatter_(1, ids, torch.arange(E, device=q.device).expand(B, E))
    rows = slot.gather(1, tree.source + 1)[:, :, None].expand(-1, -1, q.shape[-1])  # (B, N+1, W)
    # A row's candidates are distinct tokens (a top-W, or the whole vocabulary), so the scatter writes each once.
    return out.zero_().scatter_(2, cand.gather(1, rows), q.gather(1, rows))
