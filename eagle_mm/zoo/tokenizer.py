"""A byte-level BPE tokenizer trained on the corpus with the ``tokenizers`` library, as a transformers tokenizer.

Byte-level: every string round-trips (no unknown token). ``<|endoftext|>`` is the one special token and
serves as BOS, EOS and PAD; the tokenizer prepends it (``add_special_tokens=True``), so a prompt starts the way
every packed training document starts.
"""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["EOT", "train_tokenizer", "load_tokenizer"]

EOT = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 8192, min_frequency: int = 2,
                    model_max_length: int = 2048):
    """Train a byte-level BPE of ``vocab_size`` tokens (256 bytes + ``EOT`` + merges) on ``texts``.

    Returns a ``PreTrainedTokenizerFast``; ``save_pretrained(dir)`` writes it and ``load_tokenizer(dir)`` reads it.
    The result depends only on the texts and the options (the trainer's merge order is deterministic).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 1} (the byte alphabet and {EOT}), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eot = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B",
                                                       special_tokens=[(EOT, eot)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)


def load_tokenizer(path):
    """The tokenizer saved in ``path`` (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
