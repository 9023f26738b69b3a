"""generate() options through speculative_generate: stopping, streaming, processors, the HF entry point."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import eagle_mm as em
from tests.doubles import ForcedHead
from tests.tiny import V, prompt, tiny_model


def _tokenizer():
    vocab = {f"w{i}": i for i in range(V)}
    vocab["."] = vocab.pop("w0")
    vocab["abcdef"] = vocab.pop("w1")  # StopStringCriteria tokenizes this prefix to clean the vocab
    tok = Tokenizer(models.WordLevel(vocab, unk_token="."))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=".", pad_token=".")


def _forced(model, ids, n_new, rate=0.1):
    ref = model.generate(ids, max_new_tokens=n_new + 16, do_sample=False)[0]
    wrong = torch.rand(ref.numel(), generator=torch.Generator().manual_seed(1)) < rate
    return ForcedHead(em.Eagle3Head.from_target(model), ref, wrong)


CHAIN = em.TreeConfig.chain(5)


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.mark.compat
def test_streamer_receives_prompt_then_accepted_tokens():
    model = tiny_model("llama")
    ids = prompt(6)
    head = _forced(model, ids, 20)
    rec = _Recorder()
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=20, tree=CHAIN, streamer=rec)
    assert rec.ended and rec.puts[0] == ids.tolist()
    streamed = [t for chunk in rec.puts[1:] for t in chunk]
    assert streamed == out[0, ids.shape[1]:].tolist()
    assert max(len(c) for c in rec.puts[1:]) > 1  # several tokens per accepted path


def test_text_iterator_streamer_yields_final_text():
    model, tok = tiny_model("qwen2"), _tokenizer()
    ids = prompt(6)
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = em.speculative_generate(model, _forced(model, ids, 15), input_ids=ids, max_new_tokens=15, tree=CHAIN,
                                  streamer=streamer)
    text = "".join(streamer)
    assert text.split() == tok.decode(out[0, ids.shape[1]:]).split()


def _first_new(cont, start=4):
    return next(i for i in range(start, len(cont)) if int(cont[i]) not in cont[:i].tolist())


@pytest.mark.compat
def test_stop_strings_stop_where_generate_stops():
    model, tok = tiny_model("llama"), _tokenizer()
    ids = prompt(6)
    cont = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:]
    stop = tok.convert_ids_to_tokens(int(cont[_first_new(cont)]))
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    assert ref.shape[1] < ids.shape[1] + 30
    out = em.speculative_generate(model, _forced(model, ids, 30), input_ids=ids, max_new_tokens=30, tree=CHAIN,
                                  stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out, ref)


class _StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_user_stopping_criteria_and_max_length():
    model = tiny_model("mistral")
    ids = prompt(7)
    cont = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:]
    crit = StoppingCriteriaList([_StopAfterToken(int(cont[_first_new(cont, 6)]))])
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=crit)
    out = em.speculative_generate(model, _forced(model, ids, 30), input_ids=ids, max_new_tokens=30, tree=CHAIN,
                                  stopping_criteria=crit)
    assert torch.equal(out, ref)
    ref = model.generate(ids, max_length=19, do_sample=False)
    out = em.speculative_generate(model, _forced(model, ids, 30), input_ids=ids, max_length=19, tree=CHAIN)
    assert torch.equal(out, ref) and out.shape[1] == 19


@pytest.mark.parametrize("opts", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2),
                                  dict(min_new_tokens=5, eos_token_id=3), dict(suppress_tokens=[5, 7])])
def test_logits_processors_apply_at_every_node(opts):
    """Greedy with processors that read the sequence: every tree node sees its own path."""
    model = tiny_model("llama")
    ids = prompt(8, batch=2)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, **opts)
    head = em.Eagle3Head.from_target(model)
    for tree in (CHAIN, em.TreeConfig(depth=3, top_k=3, total_tokens=8)):
        out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=20, tree=tree, **opts)
        assert torch.equal(out, ref), (opts, tree)


@pytest.mark.parametrize("tree", [em.TreeConfig.none(), CHAIN, em.TreeConfig(depth=3, top_k=3, total_tokens=8)],
                         ids=["none", "chain", "tree"])
def test_minimum_length_masks_eos_until_reached(tree):
    """A minimum length with an EOS the target prefers early: the acceptance masks it at every node while every node
    is short, at none once all are long enough, and node by node in the cycles between (``processors.cycle_ops``):
    greedy equals generate's, and sampling never ends a row short."""
    model = tiny_model("llama")
    ids = prompt(8, batch=2)
    free = model.generate(ids, max_new_tokens=16, do_sample=False)[:, ids.shape[1]:]
    eos = int(free[0, 1])  # row 0's second token: without the minimum it would stop there
    opts = dict(max_new_tokens=16, min_new_tokens=9, eos_token_id=eos, pad_token_id=0)
    ref = model.generate(ids, do_sample=False, **opts)
    assert (ref[0, ids.shape[1]: ids.shape[1] + 9] != eos).all()  # the minimum changed the output
    head = em.Eagle3Head.from_target(model)
    assert torch.equal(em.speculative_generate(model, head, input_ids=ids, tree=tree, **opts), ref)
    for seed in range(3):
        out = em.speculative_generate(model, head, input_ids=ids, tree=tree, do_sample=True, top_k=4,
                                      generator=torch.Generator().manual_seed(seed), **opts)
        assert (out[:, ids.shape[1]: ids.shape[1] + 9] != eos).all(), seed


def test_cycle_ops_say_what_the_processors_do_at_every_node_or_nothing():
    from transformers.generation import logits_process as lp

    from eagle_mm.decode.processors import cycle_ops

    eos = torch.tensor([3])
    minimum = lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=8, min_new_tokens=5, eos_token_id=eos)
    temp, top = lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(4)
    kept = (lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(4))  # the decoder's sampler's, one per setting
    procs = [minimum, temp, top]

    def ops(lengths, depth, warpers=kept, processors=procs):
        return cycle_ops(processors, warpers, lambda: lengths, depth, torch.device("cpu"))

    got = ops([9, 9], 3)  # every node short of 8 + 5: EOS masked, then the kept warpers in the call's order
    assert torch.equal(got[0], eos) and got[1:] == kept
    assert ops([13, 15], 3) == kept  # every node past the minimum: no mask
    assert ops([9, 9], 3, processors=[temp, minimum, top])[0] is kept[0]  # the order is the call's
    assert ops([10, 12], 3) is None  # a row's deeper nodes reach it, its shallower ones not: node by node, eagerly
    assert ops([9, 9], 3, warpers=()) is None  # a warper without the sampler's own object (greedy)
    assert ops([9, 9], 3, processors=[lp.RepetitionPenaltyLogitsProcessor(1.2)]) is None  # reads the tokens
    assert ops([9, 9], 3, processors=[]) == ()


@pytest.mark.compat
def test_reachable_from_generate_with_custom_generate():
    model = tiny_model("llama")
    ids = prompt(6)
    head = _forced(model, ids, 16)
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=em.custom_generate, head=head,
                         tree=CHAIN, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accept_length > 2


def test_stats_report_timing_split_and_counts():
    model = tiny_model("llama")
    ids = prompt(6)
    out = em.speculative_generate(model, _forced(model, ids, 24), input_ids=ids, max_new_tokens=24, tree=CHAIN,
                                  return_dict_in_generate=True)
    st = out.stats
    assert st.num_drafts == st.num_target_forwards and st.num_draft_tokens == 5 * st.num_drafts
    assert len(st.accept_rate_per_position) == 5
    assert all(a >= b for a, b in zip(st.accept_rate_per_position, st.accept_rate_per_position[1:]))
    assert st.time_draft > 0 and st.time_verify > 0 and st.time_other > 0 and st.time_prefill > 0
    assert st.wall_time == st.time_prefill + st.time_draft + st.time_verify + st.time_other
    assert set(st.as_dict()) >= {"mean_accept_length", "accept_rate_per_position", "num_target_forwards"}


@pytest.mark.parametrize("opts,match", [
    (dict(num_beams=2), "num_beams"),
    (dict(num_return_sequences=2), "num_return_sequences"),
    (dict(penalty_alpha=0.5, top_k=4), "penalty_alpha"),
    (dict(use_cache=False), "use_cache"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    (dict(guidance_scale=2.0), "guidance_scale"),
])
def test_unsupported_options_raise_by_name(opts, match):
    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    with pytest.raises(ValueError, match=match):
        em.speculative_generate(model, head, input_ids=prompt(5), max_new_tokens=4, **opts)


def test_sampled_batch_rows_finish_independently():
    model = tiny_model("gemma3_text")
    ids = prompt(6, batch=3)
    out = em.speculative_generate(model, em.Eagle3Head.from_target(model), input_ids=ids, max_new_tokens=10,
                                  do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(0),
                                  tree=em.TreeConfig(depth=3, top_k=3, total_tokens=8), num_return_sequences=2)
    assert out.shape == (6, 16)


def test_length_processors_run_batched_as_per_node():
    """Min-length processors read only each node's sequence length: the batched path gives, node by node, what the
    processors give on the node's own sequence."""
    from transformers import LogitsProcessorList, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, \
        TemperatureLogitsWarper

    from eagle_mm.decode.processors import CallRows, node_paths, process_tree_logits
    from eagle_mm.decode.tree import Tree

    g = torch.Generator().manual_seed(0)
    parent = torch.tensor([[0, 0, 0, 1, 3], [0, 0, 1, 2, 2]])
    depth = torch.tensor([[0, 1, 1, 2, 3], [0, 1, 2, 3, 3]])
    tree = Tree(torch.randint(10, (2, 5), generator=g), parent, depth)
    rows = [torch.randint(10, (9,), generator=g), torch.randint(10, (11,), generator=g)]
    procs = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(8, 4, torch.tensor([3])),
                                 TemperatureLogitsWarper(0.7), MinLengthLogitsProcessor(12, torch.tensor([5]))])
    logits = torch.randn(2, 5, 10, generator=g)
    got = process_tree_logits(procs, CallRows(rows, [0, 1]), tree, logits, 3)
    lengths = CallRows([9, 11], [0, 1])
    assert torch.equal(process_tree_logits(procs, lengths, tree, logits, 3), got)  # lengths alone: the same
    paths = tree.tokens.gather(1, node_paths(parent, depth, 3).flatten(1)).view(2, 5, -1)
    for b in range(2):
        for i in range(5):
            seq = torch.cat((rows[b], paths[b, i, 1: int(depth[b, i]) + 1]))[None]
            assert torch.equal(got[b, i], procs(seq, logits[b, i][None].float())[0]), (b, i)
    assert torch.isinf(got).any() and not torch.isinf(got).all()  # the case exercises both sides of each minimum
    # Every row past both minimums (decided on the host, no masking): only the temperature acts.
    assert torch.equal(process_tree_logits(procs, CallRows([12, 13], [0, 1]), tree, logits, 3), logits / 0.7)


def test_output_logits_and_scores_equal_generate():
    """output_logits / output_scores: the target's logits (and processed scores) behind each committed token,
    as generate() returns them (fp32: equal up to the verify's batched rounding), accepted paths included."""
    model = tiny_model("llama")
    ids = prompt(8)
    opts = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.3, output_logits=True, output_scores=True,
                return_dict_in_generate=True)
    ref = model.generate(ids, **opts)
    longer = model.generate(ids, max_new_tokens=32, do_sample=False, repetition_penalty=1.3)[0]
    wrong = torch.rand(longer.numel(), generator=torch.Generator().manual_seed(1)) < 0.1
    head = ForcedHead(em.Eagle3Head.from_target(model), longer, wrong)  # proposes the penalized continuation
    out = em.speculative_generate(model, head, input_ids=ids, tree=CHAIN, **opts)
    assert torch.equal(out.sequences, ref.sequences) and out.stats.mean_accept_length > 2
    assert len(out.logits) == len(ref.logits) == 16 and len(out.scores) == len(ref.scores) == 16
    for ours, theirs in zip(out.logits + out.scores, ref.logits + ref.scores):
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-4)
    assert not all(torch.equal(a, b) for a, b in zip(out.logits, out.scores))  # the penalty changed the scores


def test_repetition_penalty_with_left_padding_equals_generate(monkeypatch):
    """generate() gives the repetition penalty each row's padding length (a (B,) tensor) so that the pad tokens are
    not penalized; each row's nodes see their own row's, batched per row (not the one-node-per-row path)."""
    from eagle_mm.decode import processors

    monkeypatch.setattr(processors, "_exact", lambda *a: pytest.fail("a row-wise penalty took the exact path"))
    model = tiny_model("llama")
    ids, mask = prompt(9, batch=3), torch.ones(3, 9, dtype=torch.long)
    for b, pad in enumerate((4, 0, 2)):
        ids[b, :pad], mask[b, :pad] = 0, 0
    opts = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, repetition_penalty=1.4)
    ref = model.generate(ids, **opts)
    head = em.Eagle3Head.from_target(model)
    for tree in (CHAIN, em.TreeConfig(depth=3, top_k=3, total_tokens=8)):
        out = em.speculative_generate(model, head, ids, tree=tree, **opts)
        assert torch.equal(out, ref), tree
