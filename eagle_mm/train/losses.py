"""Losses: EAGLE-1 (feature regression + token cross-entropy) and EAGLE-3 (training-time test).

Indexing, shared by both and by inference (``draft.py``): the head's entry at position t pairs the target
feature at t with the token at t+1, and predicts the feature at t+1 and so the token at t+2. The target's
distribution over token t+2 is its logits at position t+1. An entry is trained when its predicted token is
a trained (assistant) token: ``loss_mask[t + 2]``.

EAGLE-3 training-time test unrolls the head K steps over the whole sequence at once. Step i's entry at index
t stands for the chain draft at depth i+1 below a root at t+1: it reads the token at t+1+i, takes step i-1's
pre-norm output at the same index as its hidden input (step 0: fc of the target features), sits at rotary
position t+i, and predicts token t+2+i. It attends to step 0's keys at indices <= t (the committed prefix)
and to its own index in every step 1..i (its ancestors in the chain) -- the mask of ``ttt_mask``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .target import target_logits

__all__ = ["shift_left", "ttt_mask", "ttt_unroll", "eagle3_loss", "eagle1_loss"]


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded at the end with ``fill`` to the same length: (B, T, ...) -> (B, T, ...)."""
    if n == 0:
        return x
    pad = torch.full((x.shape[0], min(n, x.shape[1])) + tuple(x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat((x[:, n:], pad), dim=1)


def ttt_mask(length: int, step: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Additive mask (1, 1, T, T * (step + 1)) of TTT step ``step`` over the keys of steps 0..step.

    Block 0 (step 0's keys) is causal; blocks 1..step are diagonal (the same index only).
    Right padding needs no mask of its own: a trained query never sees a later index.
    """
    idx = torch.arange(length, device=device)
    causal = idx[None, :] <= idx[:, None]  # (T, T)
    diag = torch.eye(length, dtype=torch.bool, device=device)
    allowed = torch.cat([causal] + [diag] * step, dim=1)  # (T, T * (step + 1))
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def ttt_unroll(head, features: torch.Tensor, input_ids: torch.Tensor, steps: int,
               embeds: torch.Tensor | None = None):
    """Run the head ``steps`` times over the sequence; yields (i, logits (B, T, V_draft)) of each step.

    Step i's entry t reads token t+1+i at rotary position t+i and predicts token t+2+i (see the module doc).
    ``embeds`` (B, T, H): the target's own input embeddings (a VLM's merged text and image embeddings), read in
    place of the head's token embeddings, so an image position shows the head its image feature as at inference.
    """
    B, T = input_ids.shape
    hidden = head.fuse(features)  # (B, T, H)
    pos = torch.arange(T, device=input_ids.device).expand(B, T)
    past = None
    for i in range(steps):
        tokens = shift_left(input_ids, 1 + i)  # (B, T) token t+1+i
        mask = ttt_mask(T, i, device=input_ids.device)
        # Inputs in the head's compute dtype: FSDP mixed precision casts the weights, not the inputs.
        e = head.embed(tokens) if embeds is None else shift_left(embeds, 1 + i)
        out, logits, (k, v) = head.step(e.to(hidden.dtype), hidden, pos + i, mask, past)
        past = (k, v) if past is None else (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
        yield i, logits
        hidden = out  # pre-norm output, fed back at the same index


def eagle3_loss(head, batch: dict, *, steps: int, decay: float):
    """Training-time-test loss of an Eagle3Head: sum_i decay**i * soft cross-entropy of step i.

    batch: input_ids (B, T), loss_mask (B, T) bool, features (B, T, 3T_h) target aux states, last_hidden
    (B, T, H) the target's last normed hidden state; optional embeds (B, T, H) (see ``ttt_unroll``). The
    target's distribution is restricted to the draft vocabulary and renormalised there. Returns (loss, stats)
    with stats (2, steps) [correct; counted] per step: the draft's top token (mapped to the target vocabulary)
    equals the target's top token.
    """
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    with torch.no_grad():
        logits_t = target_logits(head.target_parts, batch["last_hidden"])  # (B, T, V)
        target_top = logits_t.argmax(-1)  # (B, T) the target's token after each position
        # Draft id j is target id draft_to_target(j): gathered by index, not by the t2d mask, whose boolean indexing
        # would wait for the GPU (it must count the mask's ids before it can allocate the result).
        draft_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=ids.device))  # (Vd,)
        target_logp = torch.log_softmax(logits_t.index_select(-1, draft_ids), dim=-1)  # (B, T, Vd) renormalised
        in_draft = head.t2d[target_top]  # (B, T) the target's choice is draftable at all
        del logits_t
    total = torch.zeros((), dtype=torch.float32, device=ids.device)
    stats = torch.zeros(2, steps, device=ids.device)
    for i, logits in ttt_unroll(head, batch["features"], ids, steps, batch.get("embeds")):
        trained = shift_left(loss_mask, 2 + i, False)  # (B, T) token t+2+i is trained
        weight = (trained & shift_left(in_draft, 1 + i, False)).float()
        p = shift_left(target_logp, 1 + i).exp()  # (B, T, Vd) zeros past the end (weight 0 there)
        ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, T)
        total = total + decay ** i * _masked_mean(ce, weight)
        with torch.no_grad():
            guess = head.draft_to_target(logits.argmax(-1))
            right = (guess == shift_left(target_top, 1 + i)) & trained
            stats[0, i], stats[1, i] = right.sum(), trained.sum()
    return total, stats


def eagle1_loss(head, batch: dict, *, noise: float, p_weight: float, v_weight: float):
    """EAGLE-1 loss of an EagleHead: v_weight * smooth-L1(out_t, feature_{t+1}) + p_weight * soft CE.

    batch: input_ids (B, T), loss_mask (B, T), features (B, T, H) the target's last normed hidden state.
    The input features get uniform noise of half-width ``noise * 512 / T`` (official EAGLE); the regression
    target is the clean feature. The token loss is the cross-entropy of the target's lm_head over the head's
    output against the target's distribution at t+1 (over token t+2). Returns (loss, stats (2, 1)).
    """
    ids, loss_mask, feats = batch["input_ids"], batch["loss_mask"], batch["features"]
    B, T = ids.shape
    with torch.no_grad():
        target_p = torch.softmax(target_logits(head.target_parts, feats), dim=-1)  # (B, T, V)
    x = feats
    if noise > 0 and head.training:
        x = feats + (torch.rand_like(feats, dtype=torch.float32) - 0.5).to(feats.dtype) * (2 * noise * 512 / T)
    causal = ttt_mask(T, 0, device=ids.device)
    pos = torch.arange(T, device=ids.device).expand(B, T)
    embeds = head.embed(shift_left(ids, 1)) if batch.get("embeds") is None else shift_left(batch["embeds"], 1)
    embeds = embeds.to(head.fc.weight.dtype)  # see ttt_unroll
    out, logits, _ = head.step(embeds, x, pos, causal, None)
    trained = shift_left(loss_mask, 2, False).float()  # (B, T)
    goal = shift_left(feats, 1).to(out.dtype)
    vloss = _masked_mean(F.smooth_l1_loss(out.float(), goal.float(), reduction="none").mean(-1), trained)
    p = shift_left(target_p, 1)
    ploss = _masked_mean(-(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1), trained)
    with torch.no_grad():
        right = (logits.argmax(-1) == p.argmax(-1)) & trained.bool()
        stats = torch.stack((right.sum(), trained.sum())).float()[:, None]
    return v_weight * vloss + p_weight * ploss, stats
