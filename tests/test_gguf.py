"""GGUF targets: a tiny random Llama written as a GGUF file by the gguf package's writer (nothing downloaded),
read through transformers' own GGUF support into a cached model folder, and used everywhere a model folder is."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

import eagle_mm as em
from eagle_mm.cli.main import main
from eagle_mm.hf import gguf as gg
from tests.gguf_files import tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The GGUF file, the model and tokenizer written into it, and the cache folder every test here converts into."""
    root = tmp_path_factory.mktemp("gguf")
    path, model, tokenizer = tiny_gguf(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gg.CACHE_ENV, str(root / "cache"))
        yield {"path": path, "model": model, "tokenizer": tokenizer, "root": root}


@pytest.fixture(scope="module")
def loaded(tiny):
    return gg.load_gguf(tiny["path"])


def test_gguf_file_loads_as_the_model_and_tokenizer_written(tiny, loaded):
    model, tokenizer = loaded
    want = tiny["model"].state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"weights differ after the GGUF round trip: {bad[:5]}"
    text = "Hello, my name is Ada.\ndef add(a, b):\n    return a + b"
    assert tokenizer(text).input_ids == tiny["tokenizer"](text).input_ids
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_speculative_generate_equals_generate_on_a_gguf_target(loaded):
    model, tokenizer = loaded
    head = em.Eagle3Head.from_target(model)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello, my name is"}],
                                         add_generation_prompt=True, tokenize=False)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    want = model.generate(**enc, max_new_tokens=24, do_sample=False, eos_token_id=None)
    got = em.speculative_generate(model, head, **enc, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert torch.equal(got, want)


def test_the_second_load_reads_the_converted_folder(tiny, monkeypatch):
    first = gg.converted_dir(tiny["path"])
    marker = json.loads((first / "eagle_mm_gguf.json").read_text())
    assert marker["sha256"] and marker["source"] == str(tiny["path"].resolve())

    def no_conversion(*args):
        raise AssertionError("converted again although the cache holds the file's folder")

    monkeypatch.setattr(gg, "_convert", no_conversion)
    assert gg.converted_dir(tiny["path"]) == first


def test_a_changed_file_is_converted_anew(tiny, tmp_path):
    other, _, _ = tiny_gguf(tmp_path, seed=1)  # same name and shape, other weights
    assert gg.converted_dir(other, cache=tmp_path / "c") != gg.converted_dir(tiny["path"], cache=tmp_path / "c")


def test_without_the_gguf_package_the_error_gives_the_install_command(tiny, monkeypatch, capsys):
    monkeypatch.setattr(gg, "_gguf_version", lambda: None)
    with pytest.raises(ImportError, match="pip install gguf"):
        gg.load_gguf(tiny["path"])
    status = main(["generate", "--target", str(tiny["path"]), "--head", str(tiny["root"]), "--prompt", "Hi"])
    assert status == 2
    assert "needs the gguf package, which is not installed: pip install gguf" in capsys.readouterr().err


def test_a_missing_gguf_file_is_named(tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path / "none.gguf"), "--head", str(tmp_path), "--prompt", "Hi"]) == 2
    assert f"no such GGUF file: {tmp_path / 'none.gguf'}" in capsys.readouterr().err


def test_an_unwritable_cache_names_the_variable(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=gg.CACHE_ENV):
        gg.converted_dir(tiny["path"], cache=blocker / "sub")


# ---- every CLI command that takes --target ---------------------------------------------------------
@pytest.fixture(scope="module")
def head_dir(tiny, loaded):
    path = tiny["root"] / "head"
    em.Eagle3Head.from_target(loaded[0]).save_pretrained(path)
    return path


def test_cli_generate_and_bench_take_a_gguf_target(tiny, head_dir, capsys):
    status = main(["generate", "--target", str(tiny["path"]), "--head", str(head_dir), "--prompt", "Hello, my",
                   "--chat", "--max-new-tokens", "12", "--compare"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "greedy outputs: identical" in out
    status = main(["bench", "--target", str(tiny["path"]), "--head", str(head_dir), "--prompt", "Hello, my",
                   "--max-new-tokens", "8"])
    assert status == 0, capsys.readouterr()


def test_cli_export_takes_a_gguf_target(tiny, head_dir, tmp_path, capsys):
    status = main(["export", str(head_dir), "--layout", "vllm", "--output", str(tmp_path / "out"), "--target",
                   str(tiny["path"])])
    out = capsys.readouterr().out
    assert status == 0, out
    assert str(tiny["path"]) in out


def test_cli_train_takes_a_gguf_target(tiny, loaded, tmp_path):
    from eagle_mm.cli.train import add_train_parser

    model, tokenizer = loaded
    rows = [{"messages": [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": "x"}]}
            for i in range(6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    parser = argparse.ArgumentParser(prog="eagle-mm")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", "--target", str(tiny["path"]), "--data", str(data), "--output",
                              str(tmp_path / "out"), "--regenerate", "--regenerate-max-new-tokens", "6",
                              "--max-steps", "2", "--batch-size", "2", "--mixed-precision", "no",
                              "--draft-vocab-size", "64"])
    assert args.func(args) == 0
    head = em.load_head(tmp_path / "out", target=model)
    assert head.config.draft_vocab_size == 64
