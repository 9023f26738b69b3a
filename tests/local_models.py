"""A tiny target, tokenizer and draft head saved to disk, as a user's local directories would be."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import eagle_mm as em
from tests.tiny import V, tiny_model

_TEXT = (
    "The capital of France is Paris . Hello , my name is Ada and I like to write Python . "
    "The best way to learn Python is to write small programs every day ."
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over exactly the target's V ids, built from a few strings (nothing downloaded).

    Words of _TEXT first, then fillers, so every id a random target emits decodes to something.
    """
    words = ["<pad>", "<unk>"] + list(dict.fromkeys(_TEXT.split()))
    words += [f"w{i}" for i in range(V - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # input_ids and attention_mask only, like a Llama tokenizer (no token_type_ids for generate()).
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   model_input_names=["input_ids", "attention_mask"])


def save_local_checkpoints(root: Path, kind: str = "eagle3") -> tuple[Path, Path]:
    """Save a tiny random Llama + tokenizer and an untrained head under ``root``: (target_dir, head_dir)."""
    model = tiny_model("llama")
    target_dir, head_dir = root / "target", root / "head"
    model.save_pretrained(target_dir)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"
    tokenizer.save_pretrained(target_dir)
    head_cls = em.Eagle3Head if kind == "eagle3" else em.EagleHead
    head_cls.from_target(model).save_pretrained(head_dir)
    return target_dir, head_dir
