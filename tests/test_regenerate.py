"""Batched regeneration: left-padded batches of prompts of different lengths give the rows of batch 1."""
from __future__ import annotations

import collections

import pytest
import torch

from eagle_mm.train.regenerate import regenerate_rows
from tests.test_train_tools import FIRST_WORD, one_thread, tiny_target, tiny_tokenizer, words  # noqa: F401


def _rows(n: int = 14, seed: int = 0) -> list[tuple[int, dict]]:
    """Chat rows with prompts of 1 to 15 words (every third a two-turn conversation) and two text rows."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 1 + int(torch.randint(0, 15, (1,), generator=g))
        user = words(torch.randint(FIRST_WORD, 96, (length,), generator=g).tolist())
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": "w1"}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "w2 w3"}, {"role": "assistant", "content": "w4"}]
        rows.append((i + 1, {"messages": msgs}))
    rows.insert(5, (100, {"text": "w5 w6 w7"}))
    rows.append((101, {"text": "w8"}))
    return rows


def test_a_batch_regenerates_the_rows_of_batch_1():
    model, tok = tiny_target(), tiny_tokenizer()
    rows = _rows()
    plain = regenerate_rows(model, tok, rows, max_new_tokens=10)
    # An end-of-sequence id among the answers' middle words, so that answers in one batch end at different steps.
    middle = collections.Counter(w for r in plain if "messages" in r
                                 for w in r["messages"][1]["content"].split()[2:8])
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(middle.most_common(1)[0][0])
    one = regenerate_rows(model, tok, rows, max_new_tokens=10, batch_size=1)
    lengths = [len(r["messages"][1]["content"].split()) for r in one if "messages" in r]
    assert min(lengths) < 10 and max(lengths) == 10, lengths  # some stopped early, some ran to the limit
    for batch_size in (4, 64):
        calls = []
        got = regenerate_rows(model, tok, rows, max_new_tokens=10, batch_size=batch_size, progress=calls.append)
        assert got == one, f"batch_size={batch_size} changed the rows"
        assert sum(calls) == len(rows)


def test_regeneration_refuses_a_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        regenerate_rows(tiny_target(), tiny_tokenizer(), _rows(2), max_new_tokens=2, batch_size=0)
