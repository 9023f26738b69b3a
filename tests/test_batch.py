"""Batches: left padding, per-row acceptance, rows finishing at different times."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import eagle_mm as em
from tests.doubles import ForcedHead
from tests.tiny import FAMILIES, V, prompt, tiny_model

LENS = [5, 12, 1, 9]


def _batch(lens=LENS):
    B, L = len(lens), max(lens)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, L - n:] = prompt(n, seed=b)[0]
        mask[b, L - n:] = 1
    return ids, mask


def _forced(model, kind, ids, mask, n_new, error_rate, seed=0):
    """Per-row greedy references indexed by position, with errors injected."""
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=n_new + 16, do_sample=False)
    pad = ids.shape[1] - mask.sum(1)
    by_pos = torch.stack([torch.roll(ref[b], -int(pad[b])) for b in range(ref.shape[0])])
    g = torch.Generator().manual_seed(seed)
    wrong = torch.rand(by_pos.shape, generator=g) < error_rate
    head = em.EagleHead.from_target(model) if kind == "eagle" else em.Eagle3Head.from_target(model)
    return ForcedHead(head, by_pos, wrong)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_batch_equals_generate(family):
    model = tiny_model(family)
    ids, mask = _batch()
    n_new = 24
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False)
    for kind, rate, tree in [("eagle3", 0.2, em.TreeConfig(depth=4, top_k=3, total_tokens=10)),
                             ("eagle", 0.35, em.TreeConfig.chain(4))]:
        head = _forced(model, kind, ids, mask, n_new, rate, seed=len(family))
        out = em.speculative_generate(model, head, input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                      tree=tree, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (family, kind)
        assert out.stats.mean_accept_length > 1.5


@pytest.mark.compat
def test_rows_finish_at_different_times_like_generate():
    model = tiny_model("llama")
    ids, mask = _batch()
    cont = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)[:, ids.shape[1]:]
    eos = int(cont[0, 6])  # row 0 stops early; other rows stop whenever they emit it, or at the limit
    model.generation_config.eos_token_id = eos
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    head = _forced(model, "eagle3", ids, mask, 30, 0.1)
    out = em.speculative_generate(model, head, input_ids=ids, attention_mask=mask, max_new_tokens=30,
                                  tree=em.TreeConfig.chain(5))
    assert torch.equal(out, ref)


@pytest.mark.compat
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled-top1"])
def test_finished_rows_stop_costing(do_sample):
    """Rows that stop early leave the batch: later verify forwards run on the live rows only (the engine's eager
    CPU run shrinks to them exactly), and the tokens stay generate()'s. ``top_k=1`` sampling is greedy's tokens
    through the sampling path (its proposal and rejection buffers move with their rows)."""
    model = tiny_model("llama")
    ids, mask = _batch()
    cont = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)[:, ids.shape[1]:]
    eos = int(cont[0, 4])
    model.generation_config.eos_token_id = eos  # row 0 stops early, others when they emit it, or at the limit
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    stops = {int((r == eos).nonzero()[0]) if (r == eos).any() else 30 for r in ref[:, ids.shape[1]:]}
    assert len(stops) >= 3  # the rows stop at three different times at least
    head = _forced(model, "eagle3", ids, mask, 30, 0.1)
    batches = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        out = em.speculative_generate(model, head, input_ids=ids, attention_mask=mask, max_new_tokens=30,
                                      tree=em.TreeConfig(depth=4, top_k=2, total_tokens=6), do_sample=do_sample,
                                      top_k=1, return_dict_in_generate=True)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, ref)
    verify = batches[1:]  # after the prefill
    assert verify == sorted(verify, reverse=True) and verify[0] == 4 and len(set(verify)) >= 3
    assert len(verify) == out.stats.num_target_forwards
    assert out.stats.num_drafts == sum(verify)  # every row a forward ran on was a live row


def test_random_head_batch_with_default_tree():
    model = tiny_model("gemma3_text")
    ids, mask = _batch()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    head = em.Eagle3Head.from_target(model)
    assert torch.equal(em.speculative_generate(model, head, input_ids=ids, attention_mask=mask, max_new_tokens=16), ref)


def test_plan_keeps_live_rows_first():
    from eagle_mm.decode.storage import plan

    fin = [True, False, False, True, False, True, True, True]
    assert plan(list(range(8)), fin, powers_of_two=False) == [1, 2, 4]
    assert plan(list(range(8)), fin, powers_of_two=True) == [1, 2, 4, 0]  # 4 rows: one finished row pads it
    assert plan([4, 1], fin, powers_of_two=False) is None  # both live
    assert plan([4, 1, 0], fin, powers_of_two=True) == [0, 1]  # 2 live of 3 rows: 2 is a power of two
    assert plan([4, 1, 2, 0], fin, powers_of_two=True) is None  # 3 live of 4: a power of two is not smaller
    assert plan([3, 4, 1, 0], fin, powers_of_two=True) == [1, 2]  # storage rows holding the call's rows 4 and 1
    assert plan([0, 3], fin, powers_of_two=False) is None  # all finished: the loop stops anyway


class _RowBias(LogitsProcessor):
    """A processor that treats rows differently: row b favours the token (7 b + its last token) mod V."""

    def __call__(self, input_ids, scores):
        b = torch.arange(input_ids.shape[0], device=scores.device)
        favoured = (7 * b + input_ids[:, -1]) % scores.shape[-1]
        return scores.scatter_add(1, favoured[:, None], torch.full_like(scores[:, :1], 3.0))


def _allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
    """prefix_allowed_tokens_fn: row b may not use tokens that are 0 mod (b + 2), nor its last token plus b."""
    last = int(sent[-1])
    return [t for t in range(V) if t % (batch_id + 2) and t != (last + batch_id) % V]


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled-top1"])
def test_row_aware_processors_equal_generate_as_rows_finish(do_sample):
    """Processors that read the row index (prefix_allowed_tokens_fn's batch_id, a custom processor) see each node
    as generate() shows that row: at the call's row index, with that row's sequence, also once finished rows have
    left the storage (its rows then map to other call rows). ``top_k=1`` sampling takes the sampled path."""
    model = tiny_model("llama")
    ids, mask = _batch([5, 9, 3])
    opts = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, prefix_allowed_tokens_fn=_allowed,
                logits_processor=LogitsProcessorList([_RowBias()]))
    cont = model.generate(ids, **opts)[:, ids.shape[1]:]
    eos = int(cont[1, 3])
    model.generation_config.eos_token_id = eos  # row 1 stops early, the others when they emit it, or at the limit
    ref = model.generate(ids, **opts)
    stops = {int((r == eos).nonzero()[0]) if (r == eos).any() else 30 for r in ref[:, ids.shape[1]:]}
    assert len(stops) >= 2, stops
    longer = model.generate(ids, **{**opts, "max_new_tokens": 46})
    pad = ids.shape[1] - mask.sum(1)
    by_pos = torch.stack([torch.roll(longer[b], -int(pad[b])) for b in range(3)])
    wrong = torch.rand(by_pos.shape, generator=torch.Generator().manual_seed(0)) < 0.15
    head = ForcedHead(em.Eagle3Head.from_target(model), by_pos, wrong)  # proposes the processed continuation
    batches = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        out = em.speculative_generate(model, head, ids, **{**opts, "do_sample": do_sample},
                                      top_k=1 if do_sample else None,
                                      tree=em.TreeConfig(depth=3, top_k=2, total_tokens=5),
                                      return_dict_in_generate=True)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accept_length > 1.5 and batches[-1] < 3  # finished rows had left the storage
