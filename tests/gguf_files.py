"""A tiny random Llama and a byte-level BPE tokenizer, written as a GGUF file with the gguf package's writer.

What llama.cpp's converter would write for a Hugging Face Llama: the per-block tensor names from gguf's own
name map, q/k rows permuted for llama.cpp's rotary layout (transformers undoes it when reading), the model's
shape as metadata, and the tokenizer as tokens, token types and merges ("gpt2", byte-level BPE).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.tiny import tiny_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_TEXT = ("The capital of France is Paris. Hello, my name is Ada and I like to write Python. "
         "def add(a, b):\n    return a + b\n") * 4


def bpe_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE over ``vocab_size`` ids: the 3 specials, the 256 bytes, merges learnt from a few lines."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                   pad_token=SPECIALS[0], model_input_names=["input_ids", "attention_mask"])


def _permute(w, n_head: int):
    """llama.cpp's rotary row order for a q or k projection (out, in) with ``n_head`` heads."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, tokenizer: PreTrainedTokenizerFast) -> Path:
    """Write a Llama ``model`` and its byte-level BPE ``tokenizer`` as one float32 GGUF file."""
    import gguf

    cfg = model.config
    n = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(n)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, tokenizer)
    for name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            w = _permute(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, cfg.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer: PreTrainedTokenizerFast) -> None:
    import gguf

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    control = set(SPECIALS)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[SPECIALS[1]])
    writer.add_eos_token_id(vocab[SPECIALS[2]])
    writer.add_pad_token_id(vocab[SPECIALS[0]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def tiny_gguf(root: Path, seed: int = 0):
    """(path of the GGUF file, the model written, the tokenizer written): a tiny random Llama of 300 ids."""
    tokenizer = bpe_tokenizer()
    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer))
    return write_gguf(root / "tiny-llama.F32.gguf", model, tokenizer), model, tokenizer
