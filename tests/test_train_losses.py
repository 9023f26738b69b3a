"""Training losses: the TTT mask, TTT against the inference-time chain draft, EAGLE-1 indexing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import eagle_mm as em
from eagle_mm.decode.draft import head_cache
from eagle_mm.train.losses import eagle1_loss, eagle3_loss, shift_left, ttt_mask, ttt_unroll
from eagle_mm.train.target import target_features, target_logits
from tests.test_train_tools import one_thread  # noqa: F401
from tests.tiny import V, prompt, tiny_model


@pytest.mark.compat
def test_ttt_mask_is_causal_then_diagonal():
    m = ttt_mask(4, 2)
    assert m.shape == (1, 1, 4, 12)
    allowed = (m[0, 0] == 0).int()
    assert allowed[:, :4].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    eye = torch.eye(4, dtype=torch.int).tolist()
    assert allowed[:, 4:8].tolist() == eye and allowed[:, 8:].tolist() == eye
    assert shift_left(torch.arange(5)[None], 2).tolist() == [[2, 3, 4, 0, 0]]


def test_ttt_steps_equal_the_inference_chain_draft():
    """TTT step i at index t must be exactly what speculative decoding computes for the depth-(i+1) chain
    node below a root at t+1, drafting the same tokens: same positions, same visible keys."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=8)
    head = em.Eagle3Head.from_target(model, draft_vocab_size=40).eval()
    head.set_draft_vocab(torch.arange(0, 80, 2))
    ids = prompt(14, batch=2)
    feats, _ = target_features(model, head.feature_layers(8), ids, torch.ones_like(ids), with_last=False)
    steps = 4
    ttt = [logits for _, logits in ttt_unroll(head, feats, ids, steps)]
    for t in (0, 3, 8):
        pos = torch.arange(t + 1).expand(2, -1)
        cache, out, logits = head_cache(head, feats[:, : t + 1], ids[:, 1: t + 2], pos)
        torch.testing.assert_close(logits[:, -1], ttt[0][:, t], atol=1e-5, rtol=1e-5)
        past, h = (cache.k, cache.v), out[:, -1:]
        for i in range(1, steps):
            tok = ids[:, t + 1 + i: t + 2 + i]  # (B, 1) the chain's depth-i token
            mask = torch.zeros(2, 1, 1, past[0].shape[2] + 1)  # the committed prefix and the chain so far
            h, lg, (k, v) = head.step(head.embed(tok), h, torch.full((2, 1), t + i), mask, past)
            past = (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
            torch.testing.assert_close(lg[:, 0], ttt[i][:, t], atol=1e-5, rtol=1e-5)


def test_eagle3_loss_soft_targets_on_the_draft_vocab_and_the_right_positions():
    torch.manual_seed(0)
    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model, draft_vocab_size=48)
    head.set_draft_vocab(torch.arange(48, 96))
    ids = prompt(10)
    feats, last = target_features(model, head.feature_layers(6), ids, torch.ones_like(ids), with_last=True)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, 6] = True  # only token 6 is trained: step i's entry 4 - i predicts it
    batch = {"input_ids": ids, "loss_mask": loss_mask, "features": feats, "last_hidden": last}
    loss, stats = eagle3_loss(head, batch, steps=3, decay=0.5)
    logits = target_logits(head.target_parts, last)
    in_draft = bool(head.t2d[logits[0, 5].argmax()])
    expected = 0.0
    p = torch.softmax(logits[0, 5, 48:], -1)  # the target's distribution over token 6, on the draft ids
    with torch.no_grad():
        for i, lg in ttt_unroll(head, feats, ids, 3):
            expected += 0.5 ** i * float(-(p * torch.log_softmax(lg[0, 4 - i], -1)).sum()) * in_draft
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert stats[1].tolist() == [1.0, 1.0, 1.0]


def test_eagle1_loss_indexing():
    torch.manual_seed(0)
    model = tiny_model("llama")
    head = em.EagleHead.from_target(model).eval()  # eval: no feature noise
    ids = prompt(9)
    feats, _ = target_features(model, (6,), ids, torch.ones_like(ids), with_last=False)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, 7] = True  # the entry at t=5 pairs feature 5 with token 6 and predicts token 7
    batch = {"input_ids": ids, "loss_mask": loss_mask, "features": feats}
    loss, stats = eagle1_loss(head, batch, noise=0.1, p_weight=0.1, v_weight=1.0)
    pos = torch.arange(9)[None]
    causal = ttt_mask(9, 0)
    with torch.no_grad():
        out, logits, _ = head.step(head.embed(shift_left(ids, 1)), feats, pos, causal, None)
        v = F.smooth_l1_loss(out[0, 5], feats[0, 6])
        p = torch.softmax(target_logits(head.target_parts, feats[0, 6]), -1)
        ce = -(p * torch.log_softmax(logits[0, 5], -1)).sum()
    assert float(loss.detach()) == pytest.approx(float(v + 0.1 * ce), rel=1e-5)
    assert stats[:, 0].tolist() == [float(logits[0, 5].argmax() == p.argmax()), 1.0]
    assert logits.shape[-1] == V  # EAGLE-1 drafts over the whole target vocabulary
