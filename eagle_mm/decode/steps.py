"""The engine's cycle steps: functions of tensors that write the storage's fixed buffers in place.

Each takes the storage's state (``storage.Target``: the target's cache and slot positions; ``storage.Buffers``: the
head's cache, the root and the cycle's tree) and the few tensors the cycle passes from one step to the next. The
runner (``runner.py``) runs each eagerly, captured as a CUDA graph, or compiled and captured. The contract they keep
for that: every tensor written in place is a static buffer (the target's cache, the ``Buffers``, the slot
positions), everything else is an output, and nothing reads the host.
"""
from __future__ import annotations

import torch

from ..hf.cache import keep_slots, set_pointers
from .accept import accept
from .draft import draft_candidates, head_entries, node_q
from .masks import tree_masks
from .processors import apply_ops
from .tree import Tree, ancestors, select_tree

__all__ = ["prefill_step", "verify_step", "draft_step", "accept_step", "update_step", "advance_step"]


def prefill_step(model, target, cap, tokens, q_pos, write, position_ids):
    """A text prompt (B, T') at positions q_pos (B, T') into slots ``write`` (T',): causal over its non-empty slots
    (q_pos >= 0). Returns the logits after the last token (B, 1, V) and the features (B, T', F)."""
    q_allowed = (q_pos[:, None, :] >= 0) & (q_pos[:, None, :] <= q_pos[:, :, None])  # (B, T', T')
    masks = tree_masks(target.kinds, target.pos, q_pos, q_allowed, model.dtype, write=write)
    out = model(input_ids=tokens, attention_mask=masks, position_ids=position_ids, **{target.kwarg: target.cache},
                use_cache=True, logits_to_keep=1)
    return out.logits, cap.features()  # a replayed graph runs no hooks: the features are outputs


def verify_step(model, target, buf, cap, write, position_ids, depth: int):
    """The tree in ``buf`` (B, Q) into slots ``write`` (Q,), each node seeing its ancestors. Returns logits
    (B, Q, V) and features (B, Q, F)."""
    masks = tree_masks(target.kinds, target.pos, buf.q_pos, ancestors(buf.parent, depth), model.dtype, write=write)
    out = model(input_ids=buf.tokens, attention_mask=masks, position_ids=position_ids,
                **{target.kwarg: target.cache}, use_cache=True)
    return out.logits, cap.features()


def draft_step(head, buf, sampler, top_k: int, depth: int, total: int) -> None:
    """Grow the EAGLE-2 tree below the root and rerank it; write buf's tokens, parent, depth, q_pos, rank (B, Q) and,
    sampling, q_nodes (B, Q, V). Reads the head's committed slots and writes its scratch slots; nothing else changes.
    Sampling reads its noise from ``buf.noise`` (drawn outside: a user's torch.Generator cannot be captured)."""
    c = draft_candidates(head, buf.head, buf.root_out, buf.root_logits, buf.root_pos, top_k, depth, sampler,
                         buf.noise if sampler is not None else None)
    tree = select_tree(buf.root, c.tokens, c.parent, c.depth, c.score, total)
    buf.tokens.copy_(tree.tokens)
    buf.parent.copy_(tree.parent)
    buf.depth.copy_(tree.depth)
    buf.q_pos.copy_(buf.root_pos[:, None] + tree.depth)
    # A candidate's index is its parent's place in the frontier times top_k plus its own rank (levels start at
    # multiples of top_k): what the acceptance's fit reads to tell the head's first choices from the rest.
    buf.rank.copy_(tree.source.clamp(min=0) % top_k)
    if sampler is not None:
        node_q(tree, c.q_rows, c.expanded, c.tokens.shape[1], buf.q_nodes)


def accept_step(buf, logits, sampled: bool, depth: int, ops: tuple):
    """The acceptance after the call's processors as ``processors.cycle_ops`` gives them (``ops``: input-free warpers
    and EOS masks, decided on the host for the cycle); sampling reads its noise (buf.u, buf.e), drawn already.
    Returns (accept_len (B,), path (B, D+1), bonus (B, 1), scores (B, Q, V): fp32, or greedy without ops the logits)."""
    B, Q, V = logits.shape
    scores = apply_ops(ops, logits.float().reshape(B * Q, V)).reshape(B, Q, V) if ops or sampled else logits
    tree = Tree(buf.tokens, buf.parent, buf.depth)
    if not sampled:
        return (*accept(tree, scores, None, depth), scores)
    return (*accept(tree, scores, buf.q_nodes, depth, noise=(buf.u, buf.e)), scores)


def update_step(head, target, buf, feats, accept_len, path, bonus) -> torch.Tensor:
    """After the acceptance: keep the accepted path, extend the head, set the next root, all in place.

    feats (B, Q, F) the target's features at the verified tree's nodes; accept_len (B,); path (B, K) node indices
    from the root (K = D+1, padded past accept_len); bonus (B, 1). Every row writes K slots at [cur, cur+K) of both
    caches and the pointer moves on by the longest path + 1: a row's slots past its own path get position -1,
    padding the next cycle overwrites. Returns (B, 1+K): the accept length, then the new tokens for the host.
    """
    cur, K = buf.cur, path.shape[1]
    j = torch.arange(K, device=path.device)  # (K,)
    # The new tokens (path nodes 1..a, then the bonus at column a) and the positions of the kept path nodes 0..a (-1
    # past a); each row's entries past its own path are padding.
    path_next = torch.cat((buf.tokens.gather(1, path[:, 1:]), bonus), 1)  # (B, K)
    new_tok = torch.where(j == accept_len[:, None], bonus, path_next)
    new_pos = torch.where(j <= accept_len[:, None], buf.q_pos.gather(1, path), -1)
    advance = accept_len.max() + 1  # () on the device: a host value here would be a sync (and a recompile)
    dst = cur + j  # (K,) slots [cur, cur+K)
    keep_slots(target.cache, path + cur, dst, cur + advance)  # the verify wrote node i at slot cur+i
    target.pos.index_copy_(1, dst, new_pos)
    # The head: entries pairing each kept node's true feature with the next committed token.
    hidden = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))  # (B, K, F)
    out, logits, (k, v) = head_entries(head, buf.head, hidden, new_tok, new_pos)  # (B, K, H), (B, K, V_draft)
    buf.head.k.index_copy_(2, dst, k)
    buf.head.v.index_copy_(2, dst, v)
    buf.head.pos.index_copy_(1, dst, new_pos)
    # The next cycle drafts from the head's output and draft logits at each row's bonus entry (column accept_len).
    last = accept_len[:, None, None]
    buf.root_out.copy_(out.gather(1, last.expand(-1, -1, out.shape[-1])).squeeze(1))
    buf.root_logits.copy_(logits.gather(1, last.expand(-1, -1, logits.shape[-1])).squeeze(1))
    buf.root.copy_(bonus.squeeze(1))
    buf.root_pos.add_(accept_len + 1)
    cur.add_(advance)
    first = ((buf.rank.gather(1, path[:, 1:]) == 0) & (j[1:] <= accept_len[:, None])).long().cumprod(1).sum(1)  # (B,)
    return torch.cat((accept_len[:, None], first[:, None], new_tok), 1)


def advance_step(target, buf, bonus) -> torch.Tensor:
    """The update after a cycle without a draft (``TreeConfig.none()``): the verified root keeps the slot ``cur`` it was
    written to, the target's token (bonus (B, 1)) becomes the next root, and the head is left as it is (nothing was
    drafted from it, and updating it would cost a head forward per token; a later tree drafts over the gap, which
    only its acceptance feels). Returns (B, 3): the accept length 0, no first choice, the new token, as
    ``update_step``'s."""
    cur = buf.cur
    target.pos.index_copy_(1, cur[None], buf.root_pos[:, None])
    set_pointers(target.cache, cur + 1)
    buf.root.copy_(bonus.squeeze(1))
    buf.root_pos.add_(1)
    cur.add_(1)
    return torch.cat((torch.zeros_like(bonus), torch.zeros_like(bonus), bonus), 1)
