"""Builders shared by the training tests: a tiny word-level tokenizer with a chat template, a tiny target saved
to disk, and data made of the target's own greedy continuations (which a head can learn quickly)."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.tiny import V, tiny_model

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
FIRST_WORD = len(SPECIALS)  # ids below this are special tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models train many times faster on one thread than on two that contend; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_tokenizer(vocab_size: int = V, chat: bool = True) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=SPECIALS[4:])
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_target(seed: int = 0, **overrides):
    """A tiny random Llama (tests/tiny.py) that never picks a special token greedily (their logits are 0,
    below the best word's), so its greedy text round-trips through the tokenizer."""
    model = tiny_model("llama", seed=seed, **overrides)
    with torch.no_grad():
        model.get_output_embeddings().weight[:FIRST_WORD] = 0.0
    return model


def save_target(path, *, chat: bool = True, seed: int = 0, **overrides):
    """``tiny_target`` and its tokenizer, saved as a target directory."""
    model = tiny_target(seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer(chat=chat).save_pretrained(path)
    return model


def words(ids) -> str:
    return " ".join(f"w{i - FIRST_WORD}" for i in ids)


def greedy_rows(model, n: int, *, prompt_len: int = 4, new: int = 44, seed: int = 0, chat: bool = False):
    """Rows whose text is a random word prompt and the target's greedy continuation (words only)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(FIRST_WORD, V, (n, prompt_len), generator=g)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new, do_sample=False)
    rows = []
    for p, full in zip(prompts.tolist(), out.tolist()):
        cont = full[prompt_len:]
        if chat:
            rows.append({"messages": [{"role": "user", "content": words(p)},
                                      {"role": "assistant", "content": words(cont)}]})
        else:
            rows.append({"text": words(p + cont)})
    return rows


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_tiny_tokenizer_round_trips_words_and_renders_chat():
    tok = tiny_tokenizer()
    ids = list(range(FIRST_WORD, FIRST_WORD + 20))
    assert tok(words(ids), add_special_tokens=False).input_ids == ids
    text = tok.apply_chat_template([{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}],
                                   tokenize=False)
    assert text == "<s><|user|> w1 <|end|> <|assistant|> w2 <|end|> "
