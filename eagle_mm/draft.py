"""The draft side of a decode cycle: extending the head's own KV cache and growing the EAGLE-2 tree.

The head's entry at position t pairs the target feature at t with the token at t+1 and predicts the
token at t+2. Its KV cache holds one entry per committed target position, with ``pos`` (B, S_h) = -1
for padding/holes, exactly like the target's slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TreeConfig
from .tree import Tree, select_tree

__all__ = ["HeadCache", "extend_head", "draft_tree"]


@dataclass
class HeadCache:
    k: torch.Tensor  # (B, nkv, S_h, hd)
    v: torch.Tensor  # (B, nkv, S_h, hd)
    pos: torch.Tensor  # (B, S_h) position of each entry, -1 if unused


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """(B, Q, K) bool -> (B, 1, Q, K) additive float mask."""
    m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return m.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def extend_head(head, cache: HeadCache | None, hidden: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                embeds: torch.Tensor | None = None):
    """Run the head on new committed entries and append them to its cache.

    hidden (B, A, F) target features; tokens (B, A) the next tokens; pos (B, A) positions, -1 = padding.
    Returns (cache, out (B, A, H), logits (B, A, V_draft)).
    """
    dtype = next(head.parameters()).dtype
    h = head.fuse(hidden)
    e = head.embed(tokens) if embeds is None else embeds.to(h.dtype)
    valid = pos >= 0
    q = pos[:, :, None]
    causal = (pos[:, None, :] <= q) & valid[:, None, :]  # (B, A, A)
    if cache is None:
        allowed, past = causal, None
    else:
        old = (cache.pos[:, None, :] >= 0) & (cache.pos[:, None, :] <= q)
        allowed, past = torch.cat((old, causal), dim=-1), (cache.k, cache.v)
    out, logits, (k, v) = head.step(e, h, pos.clamp(min=0), _additive(allowed, dtype), past)
    if cache is None:
        cache = HeadCache(k, v, pos)
    else:
        cache = HeadCache(torch.cat((cache.k, k), 2), torch.cat((cache.v, v), 2), torch.cat((cache.pos, pos), 1))
    return cache, out, logits


def draft_tree(head, cache: HeadCache, root: torch.Tensor, root_out: torch.Tensor, root_logits: torch.Tensor,
               root_pos: torch.Tensor, tree: TreeConfig) -> Tree:
    """Grow a dynamic tree below ``root`` (B,) at positions ``root_pos`` (B,).

    root_out (B, H) / root_logits (B, V_draft): the head's output at the entry that pairs the feature
    before the root with the root. The head's cache is not modified.
    """
    B, k = root.shape[0], tree.top_k
    dtype = next(head.parameters()).dtype
    logp = torch.log_softmax(root_logits.float(), dim=-1)  # (B, Vd)
    score, ids = logp.topk(k, dim=-1)  # (B, k)
    tok = head.draft_to_target(ids)
    cand_tok, cand_score, cand_parent = [tok], [score], [torch.full_like(ids, -1)]
    cand_depth = [torch.ones(k, dtype=torch.long, device=root.device)]
    front_idx = torch.arange(k, device=root.device).expand(B, k)  # candidate ids of the frontier
    front_hidden = root_out[:, None, :].expand(B, k, root_out.shape[-1])
    front_anc = torch.zeros(B, k, 0, dtype=torch.bool, device=root.device)  # ancestry over tree entries
    tk = tv = None
    n_cand = k
    past_ok = cache.pos >= 0  # (B, S_h)
    for d in range(1, tree.depth):
        # Run the head on the frontier (depth-d nodes) to propose depth d+1.
        pos = (root_pos + d - 1)[:, None].expand(B, k)  # a depth-d node pairs with the feature at depth d-1
        allowed = torch.cat((past_ok[:, None, :].expand(B, k, -1), front_anc,
                             torch.eye(k, dtype=torch.bool, device=root.device).expand(B, k, k)), dim=-1)
        past = (cache.k, cache.v) if tk is None else (torch.cat((cache.k, tk), 2), torch.cat((cache.v, tv), 2))
        out, logits, (k_new, v_new) = head.step(head.embed(tok), front_hidden, pos, _additive(allowed, dtype), past)
        tk = k_new if tk is None else torch.cat((tk, k_new), 2)
        tv = v_new if tv is None else torch.cat((tv, v_new), 2)
        child_score, child_ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # (B, k, k)
        child_score = child_score + score[:, :, None]
        cand_tok.append(head.draft_to_target(child_ids).flatten(1))
        cand_score.append(child_score.flatten(1))
        cand_parent.append(front_idx[:, :, None].expand(B, k, k).flatten(1))
        cand_depth.append(torch.full((k * k,), d + 1, dtype=torch.long, device=root.device))
        # The next frontier: the k best children overall.
        score, pick = child_score.flatten(1).topk(k, dim=-1)  # (B, k)
        par = torch.div(pick, k, rounding_mode="floor")  # frontier slot of each pick's parent
        tok = cand_tok[-1].gather(1, pick)
        front_idx = n_cand + pick
        n_cand += k * k
        front_hidden = out.gather(1, par[:, :, None].expand(-1, -1, out.shape[-1]))
        n_entries = tk.shape[2]
        own = torch.zeros(B, k, n_entries, dtype=torch.bool, device=root.device)
        own.scatter_(2, (n_entries - k + par)[:, :, None], True)
        front_anc = torch.cat((front_anc.gather(1, par[:, :, None].expand(-1, -1, front_anc.shape[2])),
                               torch.zeros(B, k, k, dtype=torch.bool, device=root.device)), dim=2) | own
    return select_tree(
        root, torch.cat(cand_tok, 1), torch.cat(cand_parent, 1), torch.cat(cand_depth),
        torch.cat(cand_score, 1), tree.total_tokens,
    )
