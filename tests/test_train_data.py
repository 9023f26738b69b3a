"""Training data: chat loss masks, text rows, bad rows, regeneration, the draft vocabulary, the batch plan."""
from __future__ import annotations

import pytest
import torch

from eagle_mm.train.data import BatchPlan, Example, build_draft_vocab, collate, encode_rows, read_rows
from eagle_mm.train.regenerate import regenerate_rows
from tests.test_train_tools import FIRST_WORD, one_thread, tiny_target, tiny_tokenizer, words, write_jsonl  # noqa: F401

CHAT = {"messages": [
    {"role": "system", "content": "w1 w2"},
    {"role": "user", "content": "w3 w4 w5"},
    {"role": "assistant", "content": "w6 w7"},
    {"role": "user", "content": "w8"},
    {"role": "assistant", "content": "w9 w10 w11"},
]}


def _tokens(tok, ids):
    return tok.convert_ids_to_tokens(ids)


@pytest.mark.compat
def test_chat_loss_mask_covers_assistant_turns_and_their_end_marker(tmp_path):
    tok = tiny_tokenizer()
    (ex,) = encode_rows(tok, read_rows(write_jsonl(tmp_path / "d.jsonl", [CHAT])), max_length=100)
    toks = _tokens(tok, ex.input_ids.tolist())
    trained = [t for t, m in zip(toks, ex.loss_mask.tolist()) if m]
    assert toks[0] == "<s>"
    assert trained == ["w6", "w7", "<|end|>", "w9", "w10", "w11", "<|end|>"]


def test_text_rows_train_every_token_and_truncate(tmp_path):
    tok = tiny_tokenizer()
    rows = [{"text": words(range(FIRST_WORD, FIRST_WORD + 30))}, {"text": "w1 w2"}]
    examples = encode_rows(tok, read_rows(write_jsonl(tmp_path / "d.jsonl", rows)), max_length=12)
    assert len(examples) == 1  # the two-token row has nothing to predict (entry t predicts token t+2)
    assert examples[0].input_ids.tolist() == list(range(FIRST_WORD, FIRST_WORD + 12))
    assert bool(examples[0].loss_mask.all()) and examples[0].row == 1


def test_bad_rows_name_the_row_or_path(tmp_path):
    ok = {"text": "w1 w2 w3"}
    no_assistant = {"messages": [{"role": "user", "content": "w1"}]}
    with pytest.raises(ValueError, match=r"row 2: no assistant turn"):
        read_rows(write_jsonl(tmp_path / "a.jsonl", [ok, no_assistant]))
    missing = {"text": "w1", "images": ["pics/cat.png"]}
    with pytest.raises(ValueError, match=r"row 1: image 'pics/cat.png' does not exist"):
        read_rows(write_jsonl(tmp_path / "b.jsonl", [missing]))
    (tmp_path / "cat.png").write_bytes(b"\x89PNG")
    present = {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"}]},
                            {"role": "assistant", "content": "w2"}]}
    with pytest.raises(ValueError, match=r"row 1: rows with images need the vision-language data path"):
        read_rows(write_jsonl(tmp_path / "c.jsonl", [present]))
    (tmp_path / "d.jsonl").write_text('{"text": "w1"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"row 2: not valid JSON"):
        read_rows(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match=r"row 1: expected an object with either 'messages'"):
        read_rows(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "w1"}]))


def test_chat_rows_need_a_chat_template(tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [{"text": "w1 w2 w3"}, CHAT]))
    with pytest.raises(ValueError, match=r"no chat_template.*row 2 is a chat"):
        encode_rows(tiny_tokenizer(chat=False), rows, max_length=64)


def test_regenerate_replaces_assistant_turns_by_the_targets_greedy_output(tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [CHAT]))
    (row,) = regenerate_rows(model, tok, rows, max_new_tokens=5)
    msgs = row["messages"]
    assert [m["role"] for m in msgs] == [m["role"] for m in CHAT["messages"]]
    assert msgs[1] == CHAT["messages"][1] and msgs[2]["content"] != CHAT["messages"][2]["content"]
    # The second assistant turn continues the conversation that holds the regenerated first one.
    prompt = tok.apply_chat_template(msgs[:4], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids])
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:]
    assert msgs[4]["content"] == tok.decode(greedy)
    assert len(msgs[4]["content"].split()) == 5


def test_draft_vocab_takes_the_most_frequent_trained_tokens():
    ids = torch.tensor([5, 5, 5, 7, 7, 9, 9, 2, 2, 2, 2])
    mask = torch.tensor([True] * 7 + [False] * 4)  # the 2s are not trained on
    vocab = build_draft_vocab([Example(ids, mask, 1)], vocab_size=12, draft_vocab_size=4)
    assert vocab.tolist() == [0, 5, 7, 9]  # 5, then 7 and 9 (a tie, by id), then the lowest unseen id
    with pytest.raises(ValueError, match="exceeds"):
        build_draft_vocab([], vocab_size=12, draft_vocab_size=13)


def test_batch_plan_is_a_deterministic_partition():
    plan = BatchPlan(num_rows=23, batch_size=2, world=2, accum=2, seed=3)
    assert plan.steps_per_epoch == 2  # 11 micro-batches -> 2 steps of 4; 3 are dropped
    seen = [r for step in range(2) for m in range(2) for rank in range(2) for r in plan.rows(step, m, rank)]
    assert len(seen) == len(set(seen)) == 16 and set(seen) <= set(range(23))
    assert plan.rows(2, 0, 0) != plan.rows(0, 0, 0)  # a new epoch, a new order
    assert plan.rows(3, 1, 1) == BatchPlan(23, 2, 2, 2, 3).rows(3, 1, 1)
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        BatchPlan(num_rows=3, batch_size=2, world=2, accum=1, seed=0).check()


def test_collate_pads_on_the_right():
    a = Example(torch.tensor([3, 4, 5]), torch.tensor([False, True, True]), 1, {"features": torch.ones(3, 2)})
    b = Example(torch.tensor([6, 7]), torch.tensor([True, True]), 2, {"features": torch.ones(2, 2)})
    batch = collate([a, b])
    assert batch["input_ids"].tolist() == [[3, 4, 5], [6, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, True, False]]
    assert batch["features"][1, 2].tolist() == [0.0, 0.0]
