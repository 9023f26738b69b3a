"""What a call returns and streams: generate()'s output class, and streamer= on every route."""
from __future__ import annotations

import pytest
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

import eagle_mm as em
from tests.tiny import prompt, tiny_model

CHAIN = em.TreeConfig.chain(3)


class _Recorder(BaseStreamer):
    """Accepts any shape, as a user's own streamer may: the batch refusal must not rely on TextStreamer's."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.fixture(scope="module")
def model_and_head():
    model = tiny_model("llama")
    return model, em.Eagle3Head.from_target(model)


@pytest.mark.compat  # the output class's fields and the cache's name differ across releases
def test_the_output_is_generates_output_class(model_and_head):
    model, head = model_and_head
    ids = prompt(5)
    out = em.speculative_generate(model, head, input_ids=ids, max_new_tokens=6, tree=CHAIN,
                                  return_dict_in_generate=True, output_scores=True)
    assert isinstance(out, em.SpeculativeOutput)
    assert isinstance(out, GenerateDecoderOnlyOutput) and isinstance(out, ModelOutput)
    assert out["sequences"] is out.sequences and out[0] is out.sequences
    assert out.to_tuple()[0] is out.sequences and out.to_tuple()[-1] is out.stats
    assert out["stats"].mean_accept_length >= 1.0 and len(out.scores) == 6
    assert "sequences" in out.keys() and "stats" in out.keys()
    # The loop's cache is its own (draft-tree slots): not returned, under either name.
    cache = getattr(out, "cache", None) if "cache" in type(out).__dataclass_fields__ else out.past_key_values
    assert cache is None and out.attentions is None and out.hidden_states is None


@pytest.mark.compat  # reads a private detail of generate (hf/streamer.py)
def test_custom_generate_streams_the_streamer_given_to_generate(model_and_head):
    model, head = model_and_head
    ids = prompt(5)
    rec = _Recorder()
    out = model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=em.custom_generate, head=head,
                         tree=CHAIN, streamer=rec)
    assert rec.ended and rec.puts[0] == ids.tolist()  # the prompt, sent by generate itself
    assert [t for chunk in rec.puts[1:] for t in chunk] == out[0, ids.shape[1]:].tolist()


def test_a_batch_with_a_streamer_is_refused_up_front(model_and_head):
    from transformers import TextStreamer

    from tests.test_generate_options import _tokenizer

    model, head = model_and_head
    ids = prompt(5, batch=2)
    with pytest.raises(ValueError, match=r"streamer= shows one sequence, but this call decodes 2 rows"):
        em.speculative_generate(model, head, input_ids=ids, max_new_tokens=4, tree=CHAIN,
                                streamer=TextStreamer(_tokenizer()))
    rec = _Recorder()
    with pytest.raises(ValueError, match=r"decodes 2 rows .*drop streamer="):
        model.generate(ids, max_new_tokens=4, custom_generate=em.custom_generate, head=head, tree=CHAIN, streamer=rec)
    assert rec.puts == [ids.tolist()] and not rec.ended  # only generate's own put of the prompt, no token
    with pytest.raises(ValueError, match=r"decodes 3 rows"):  # one prompt, three samples
        em.speculative_generate(model, head, input_ids=prompt(5), max_new_tokens=4, tree=CHAIN, do_sample=True,
                                num_return_sequences=3, streamer=_Recorder())
