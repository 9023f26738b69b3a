"""The engine's cycle steps: pure functions of tensors that write the fixed buffers in place.

``FixedStorage`` (fixed.py) runs each as ``graphs.wrapped`` says: eagerly, captured as a CUDA graph, or compiled
and captured. The contract they keep for that: every tensor written in place is a static buffer (the target's
``StaticLayer`` cache, ``fixed.Buffers``, the slot positions), everything else is an output, and nothing reads
the host.
"""
from __future__ import annotations

import torch

from .accept import accept, committed
from .draft import HeadCache, bonus_entry, draft_candidates, head_entries, node_q
from .masks import tree_masks
from .tree import Tree, ancestors, select_tree

__all__ = ["prefill_step", "verify_step", "draft_step", "accept_step", "update_step", "advance_step", "keep_slots"]


def _forward(model, cache, kinds, kwarg: str, cap, tokens, q_pos, q_allowed, slot_pos, write, position_ids, **kw):
    masks = tree_masks(kinds, slot_pos, q_pos, q_allowed, model.dtype, write=write)
    logits = model(input_ids=tokens, attention_mask=masks, position_ids=position_ids, **{kwarg: cache},
                   use_cache=True, **kw).logits
    return logits, cap.features()  # a replayed graph runs no hooks: the features are outputs


def prefill_step(model, cache, kinds, kwarg: str, cap, tokens, q_pos, slot_pos, write, position_ids):
    """A text prompt (B, T') into slots ``write``: causal over its non-empty slots (q_pos >= 0). Returns the logits
    after the last token (B, 1, V) and the features (B, T', F)."""
    q_allowed = (q_pos[:, None, :] >= 0) & (q_pos[:, None, :] <= q_pos[:, :, None])  # (B, T', T')
    return _forward(model, cache, kinds, kwarg, cap, tokens, q_pos, q_allowed, slot_pos, write, position_ids,
                    logits_to_keep=1)


def verify_step(model, cache, kinds, kwarg: str, cap, tokens, q_pos, parent, slot_pos, write, position_ids,
                depth: int):
    """The tree (B, Q) into slots ``write``, each node seeing its ancestors. Returns logits (B, Q, V), features."""
    return _forward(model, cache, kinds, kwarg, cap, tokens, q_pos, ancestors(parent, depth), slot_pos, write,
                    position_ids)


def draft_step(head, head_k, head_v, head_pos, root, root_pos, root_out, root_logits, tokens, parent, depth_out,
               q_pos, q_nodes, noise, sampler, top_k: int, depth: int, total: int) -> None:
    """Grow the EAGLE-2 tree below the root and rerank it; write tokens, parent, depth, q_pos (B, Q) and, sampling,
    q_nodes (B, Q, V). Reads the head's committed slots and writes its scratch slots; nothing else changes."""
    cache = HeadCache(head_k, head_v, head_pos, 0, head_k.shape[2] - head_pos.shape[1])
    c = draft_candidates(head, cache, root_out, root_logits, root_pos, top_k, depth, sampler, noise)
    tree = select_tree(root, c.tokens, c.parent, c.depth, c.score, total)
    tokens.copy_(tree.tokens)
    parent.copy_(tree.parent)
    depth_out.copy_(tree.depth)
    q_pos.copy_(root_pos[:, None] + tree.depth)
    if sampler is not None:
        node_q(tree, c.q_rows, c.expanded, c.tokens.shape[1], q_nodes)


def accept_step(tokens, parent, depth_t, logits, q_nodes, u, e, sampler, depth: int):
    """The sampled acceptance of ``accept.accept`` with its noise (u, e) given and the processors being the sampler's
    input-free warpers (the same settings as the call's): (accept_len (B,), path (B, D+1), bonus (B, 1), scores)."""
    return accept(Tree(tokens, parent, depth_t), logits, q_nodes, sampler.warpers, [], depth, None, noise=(u, e))


def keep_slots(keys: list, values: list, lengths: list, src: torch.Tensor, dst: torch.Tensor,
               new_len: torch.Tensor) -> None:
    """In place, per layer: slots dst (K,) <- slots src (B, K) of each row; the write pointer <- new_len."""
    for t in (*keys, *values):
        B, h, _, d = t.shape
        idx = src.to(t.device)[:, None, :, None].expand(B, h, -1, d)
        t.index_copy_(2, dst.to(t.device), t.gather(2, idx))  # gather first: source and target may overlap
    for n in lengths:
        n.copy_(new_len)


def update_step(head, keys: list, values: list, lengths: list, target_pos, head_k, head_v, head_pos, cur, root,
                root_pos, root_out, root_logits, tokens, q_pos, feats, accept_len, path, bonus) -> torch.Tensor:
    """After the acceptance: keep the accepted path, extend the head, set the next root, all in place.

    tokens, q_pos (B, Q) the verified tree; feats (B, Q, F) the target's features at its nodes; accept_len (B,);
    path (B, K) node indices from the root (K = D+1, padded past accept_len); bonus (B, 1). Every row writes K
    slots at [cur, cur+K) of both caches and the pointer moves on by the longest path + 1: a row's slots past its
    own path get position -1, padding the next cycle overwrites. Returns (B, 1+K): the accept length, then the
    new tokens for the host.
    """
    new_tok, new_pos = committed(tokens, q_pos, accept_len, path, bonus)  # (B, K) each
    j = torch.arange(path.shape[1], device=path.device)  # (K,)
    advance = accept_len.max() + 1  # () on the device: a host value here would be a sync (and a recompile)
    dst = cur + j  # (K,) slots [cur, cur+K)
    keep_slots(keys, values, lengths, path + cur, dst, cur + advance)  # the verify wrote node i at slot cur+i
    target_pos.index_copy_(1, dst, new_pos)
    # The head: entries pairing each kept node's true feature with the next committed token.
    hidden = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))  # (B, K, F)
    cache = HeadCache(head_k, head_v, head_pos, 0, head_k.shape[2] - head_pos.shape[1])
    out, logits, (k, v) = head_entries(head, cache, hidden, new_tok, new_pos)  # (B, K, H), (B, K, V_draft)
    head_k.index_copy_(2, dst, k)
    head_v.index_copy_(2, dst, v)
    head_pos.index_copy_(1, dst, new_pos)
    next_out, next_logits = bonus_entry(out, logits, accept_len)
    root_out.copy_(next_out)
    root_logits.copy_(next_logits)
    root.copy_(bonus.squeeze(1))
    root_pos.add_(accept_len + 1)
    cur.add_(advance)
    return torch.cat((accept_len[:, None], new_tok), 1)


def advance_step(lengths: list, target_pos, cur, root, root_pos, bonus) -> torch.Tensor:
    """After a cycle without a draft (``TreeConfig.none()``): the verified root keeps the slot ``cur`` it was written
    to, the target's token becomes the next root, and the head is left as it is (nothing was drafted from it, and
    updating it would cost a head forward per token; a later tree drafts over the gap, which only its acceptance
    feels). bonus (B, 1). Returns (B, 2): the accept length 0, then the new token, as ``update_step``'s output."""
    target_pos.index_copy_(1, cur[None], root_pos[:, None])
    for n in lengths:
        n.copy_(cur + 1)
    root.copy_(bonus.squeeze(1))
    root_pos.add_(1)
    cur.add_(1)
    return torch.cat((torch.zeros_like(bonus), bonus), 1)
