"""The reference-model zoo: corpus, tokenizer, pre-training, the one-command build (toy size), loading, the benchmark.

The toy build (``python -m eagle_mm.zoo.code_tiny build --toy``) runs once for the module, on a CPU, in seconds;
the tests then load it through ``EAGLE_MM_ZOO_DIR`` exactly as a user loads the shipped model.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import math
from pathlib import Path

import pytest
import torch

import eagle_mm
from eagle_mm import zoo
from eagle_mm.zoo.code_tiny import MB, budget, build, merge_heads, real_config, toy_config
from eagle_mm.zoo.corpus import def_prompts, is_validation, list_files, load_corpus
from eagle_mm.zoo.pretrain import ModelShape, PretrainConfig, pretrain
from eagle_mm.zoo.tokenizer import EOT, load_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(zoo root holding code-tiny/, the build's manifest)."""
    root = tmp_path_factory.mktemp("zoo")
    manifest = build(root / "code-tiny", seed=0, toy=True, device="cpu")
    return root, manifest


@pytest.fixture
def loaded(built, monkeypatch):
    monkeypatch.setenv(zoo.ZOO_ENV, str(built[0]))
    return zoo.load("code-tiny")


# ---- corpus ----------------------------------------------------------------------------------------
def _fake_stdlib(root: Path) -> None:
    files = {
        "os.py": "import sys\n\ndef f(x):\n    return x\n",
        "json/__init__.py": "class A:\n    pass\n",
        "test/test_os.py": "def test(): pass\n",
        "unittest/test/test_case.py": "def test(): pass\n",
        "idlelib/run.py": "x = 1\n",
        "site-packages/pkg/mod.py": "x = 1\n",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "build_time_vars = {}\n",
        "empty.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def test_corpus_skips_tests_ide_third_party_and_machine_files(tmp_path):
    _fake_stdlib(tmp_path)
    assert list_files(tmp_path) == ["empty.py", "json/__init__.py", "os.py"]


def test_corpus_split_is_deterministic_disjoint_and_complete():
    files = list_files()
    assert files == list_files() and len(files) > 100
    assert not any(p.split("/")[0] in ("test", "idlelib", "site-packages") for p in files)
    val = {p for p in files if is_validation(p, 0.02)}
    train = set(files) - val
    assert val and train and not val & train
    assert 0.005 < len(val) / len(files) < 0.05
    # A pure function of the path: the same answer every time, on every machine.
    assert val == {p for p in files if is_validation(p, 0.02)}
    a, b = load_corpus(max_bytes=60_000, val_fraction=0.1), load_corpus(max_bytes=60_000, val_fraction=0.1)
    assert a.digest() == b.digest()
    assert {d.path for d in a.train}.isdisjoint({d.path for d in a.val})
    assert all(is_validation(d.path, 0.1) for d in a.val) and not any(is_validation(d.path, 0.1) for d in a.train)


def test_def_prompts_end_at_a_def_line():
    corpus = load_corpus(max_bytes=60_000, val_fraction=0.1)
    prompts = def_prompts(corpus.val + corpus.train, 6, context_lines=5)
    assert len(prompts) == 6
    for p in prompts:
        lines = p.splitlines()
        assert 1 <= len(lines) <= 5
        assert lines[-1].lstrip().startswith(("def ", "class ", "async def ")) and lines[-1].endswith(":")
        assert p.endswith(":")  # no bare newline token: the body's first token is newline + indent


# ---- tokenizer -----------------------------------------------------------------------------------
_CODE = [
    "def f(x):\n    return x + 1\n",
    "class A:\n    \"\"\"Ünïcödé and tabs\there.\"\"\"\n\n    def g(self):\n        return {'a': [1, 2]}\n",
] * 20


def test_tokenizer_round_trips_and_prepends_eot(tmp_path):
    tok = train_tokenizer(_CODE, vocab_size=300)
    assert len(tok) == 300 and tok.eos_token == tok.bos_token == tok.pad_token == EOT
    text = "async def héllo(a,\tb):\n        return a  # ✓ €\n\n\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.eos_token_id and tok.eos_token_id not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again(text).input_ids == ids and again.eos_token_id == tok.eos_token_id
    assert train_tokenizer(_CODE, vocab_size=300).get_vocab() == tok.get_vocab()


# ---- pre-training --------------------------------------------------------------------------------
def test_pretrain_is_deterministic_and_learns():
    shape = ModelShape(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       max_position_embeddings=64)
    cfg = PretrainConfig(shape=shape, block_size=16, batch_size=4, max_steps=12, warmup_steps=2, eval_every=6,
                         lr=1e-2, seed=3)
    stream = torch.arange(2000) % 7  # a periodic stream: easy to learn
    runs = [pretrain(cfg, stream, stream[:200], vocab_size=11, eot_id=0) for _ in range(2)]
    first, second = (r.model.state_dict() for r in runs)
    assert all(torch.equal(first[k], second[k]) for k in first)
    r = runs[0]
    assert r.val_loss < r.history[0]["val_loss"] - 0.5 and r.val_perplexity == pytest.approx(math.exp(r.val_loss))
    assert r.steps == 12 and r.tokens_seen == 12 * 4 * 16 and not r.stopped_early


# ---- sizes ---------------------------------------------------------------------------------------
def test_real_configuration_fits_the_budget():
    sizes = budget(real_config(), tokenizer_bytes=600_000)  # the trained 8k tokenizer.json is ~0.55 MB
    assert sizes["total_bytes"] < 30 * MB
    assert sizes["parts"]["target"]["bytes"] > 0.5 * sizes["total_bytes"]  # the target is the point of it


def test_over_budget_is_refused_before_training(tmp_path):
    cfg = toy_config()
    cfg.budget_bytes = 1000
    with pytest.raises(ValueError, match="over the 0 MB budget"):
        build(tmp_path / "x", toy=True, config=cfg)
    assert not (tmp_path / "x" / "target").exists()


def test_heads_stage_needs_the_base_stage(tmp_path):
    with pytest.raises(FileNotFoundError, match="--stage base"):
        build(tmp_path / "x", toy=True, stage="heads")


def test_heads_must_be_known(tmp_path):
    with pytest.raises(ValueError, match="heads must name"):
        build(tmp_path / "x", toy=True, stage="heads", heads=("medusa",))


# ---- the toy build -----------------------------------------------------------------------------
def test_manifest_describes_the_build(built):
    root, manifest = built
    out = root / "code-tiny"
    on_disk = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert on_disk == manifest
    assert manifest["name"] == "code-tiny" and manifest["toy"] is True and manifest["seed"] == 0
    assert manifest["complete"] is True and not (out / ".work").exists()
    assert set(manifest["versions"]) >= {"python", "torch", "transformers", "tokenizers", "eagle_mm"}
    assert manifest["corpus"]["train_files"] > 0 and manifest["corpus"]["val_files"] > 0
    for part in ("target", "assistant"):
        info = manifest[part]
        assert math.isfinite(info["val_loss"]) and info["val_perplexity"] == pytest.approx(math.exp(info["val_loss"]))
        assert info["val_bits_per_byte"] > 0 and info["val_loss_bf16"] == pytest.approx(info["val_loss"], rel=0.02)
    for kind in ("eagle", "eagle3"):
        assert manifest[kind]["steps"] == toy_config().heads.max_steps
        assert manifest[kind]["val_mean_accept_length"] >= 1.0
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert manifest["files"] == {k: v for k, v in files.items() if k != "manifest.json"}
    assert manifest["total_bytes"] == sum(manifest["files"].values())
    shards = [size for name, size in files.items() if name.endswith(".safetensors")]
    assert max(shards) <= toy_config().max_shard_bytes
    # The budget arithmetic predicts the weight files (up to safetensors headers).
    for part, info in manifest["budget"]["parts"].items():
        weights = sum(size for name, size in files.items()
                      if name.startswith(f"{part}/") and name.endswith(".safetensors"))
        assert info["bytes"] <= weights <= info["bytes"] + 8192, part


def test_retraining_one_head_keeps_the_other(built, tmp_path):
    src = built[0] / "code-tiny"
    out = tmp_path / "code-tiny"
    shutil.copytree(src, out)
    before = {p.name: p.read_bytes() for p in (out / "eagle").iterdir()}
    cfg = toy_config()
    cfg.heads.lr = 1e-3  # a different run: the retrained head's weights change
    manifest = build(out, seed=0, toy=True, stage="heads", config=cfg, heads=("eagle3",))
    assert {p.name: p.read_bytes() for p in (out / "eagle").iterdir()} == before
    assert manifest["eagle"] == built[1]["eagle"] and manifest["eagle3"] != built[1]["eagle3"]
    assert manifest["eagle3"]["train_config"]["aux_layers"] == [1, 2, 4]
    assert manifest["config"]["heads"]["lr"] == 1e-3 and manifest["complete"]


def test_heads_trained_apart_merge_into_one_build(built, tmp_path):
    src = built[0] / "code-tiny"
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    cfg = toy_config()
    cfg.heads.lr = 1e-3
    theirs = build(b, seed=0, toy=True, stage="heads", config=cfg, heads=("eagle3",))
    merged = merge_heads(a, b, ["eagle3"])
    assert merged["eagle3"] == theirs["eagle3"] and merged["eagle"] == built[1]["eagle"]
    assert (a / "eagle3" / "model.safetensors").read_bytes() == (b / "eagle3" / "model.safetensors").read_bytes()
    assert merged["files"] == theirs["files"] and merged["complete"]
    other = json.loads((b / "manifest.json").read_text(encoding="utf-8"))
    other["corpus"]["sha256"] = "0" * 64
    (b / "manifest.json").write_text(json.dumps(other), encoding="utf-8")
    with pytest.raises(ValueError, match="same base"):
        merge_heads(a, b, ["eagle3"])


def test_load_from_env_dir(loaded, built):
    z = loaded
    assert z.name == "code-tiny" and z.path == built[0] / "code-tiny"
    assert isinstance(z.eagle_head, eagle_mm.EagleHead) and isinstance(z.eagle3_head, eagle_mm.Eagle3Head)
    assert z.target.dtype == torch.float32 and z.assistant.dtype == torch.float32  # fp32 on a CPU
    assert z.target.config._attn_implementation == "sdpa"
    assert z.assistant.config.num_hidden_layers == 2 and len(z.prompts) == toy_config().prompts
    assert z.tokenizer.eos_token_id == z.target.generation_config.eos_token_id


@pytest.mark.parametrize("head_name", ["eagle_head", "eagle3_head"])
@pytest.mark.parametrize("tree", [None, eagle_mm.TreeConfig.chain(3)])
def test_greedy_speculative_equals_generate(loaded, head_name, tree):
    z = loaded
    enc = z.tokenizer(z.prompts[1], return_tensors="pt")
    reference = z.target.generate(**enc, max_new_tokens=12, do_sample=False)
    out = eagle_mm.speculative_generate(z.target, getattr(z, head_name), **enc, max_new_tokens=12, do_sample=False,
                                        tree=tree)
    assert torch.equal(out, reference)


def test_missing_model_names_the_path_and_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(zoo.ZOO_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError) as excinfo:
        zoo.load("code-tiny")
    message = str(excinfo.value)
    assert str(tmp_path / "code-tiny") in message and "python -m eagle_mm.zoo.code_tiny build --out" in message
    assert not zoo.is_available("code-tiny")
    with pytest.raises(ValueError, match="unknown zoo model 'nope'; known: code-tiny"):
        zoo.load("nope")


def test_incomplete_build_is_refused(built, tmp_path):
    out = tmp_path / "code-tiny"
    out.mkdir()
    manifest = dict(built[1], complete=False)
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ValueError, match="incomplete build.*--stage heads"):
        zoo.load_dir(out)


# ---- the benchmark and the demo on the toy build -------------------------------------------------
def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_code_tiny", ROOT / "bench" / "bench_code_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_runs_every_method(built, tmp_path):
    bench = _bench_module()
    out = tmp_path / "bench.json"
    result = bench.main(["--zoo-dir", str(built[0] / "code-tiny"), "--prompts", "1", "--max-new-tokens", "6",
                         "--chain-depth", "2", "--depth", "2", "--top-k", "2", "--total-tokens", "3",
                         "--out", str(out)])
    assert json.loads(out.read_text(encoding="utf-8")) == json.loads(json.dumps(result))
    rows = {(r["mode"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(m, k) for m in bench.MODES for k in bench.METHODS}
    for mode in bench.MODES:
        assert rows[(mode, "generate")]["mean_accept_length"] == 1.0
        assert rows[(mode, "generate")]["speedup"] == 1.0
    for method in bench.METHODS[1:]:
        assert rows[("greedy", method)]["matches_generate"] is True, method
    for method in ("eagle_chain", "eagle3_tree", "eagle3_auto"):
        assert rows[("greedy", method)]["eagle_stats_mean_accept_length"] >= 1.0
    auto = result["meta"]["auto"]  # calibrated on prompts the benchmark does not measure
    assert auto["calib_prompts"] == 4
    assert [auto["tree"][k] for k in ("depth", "top_k", "total_tokens")] == \
        [auto["chosen"][k] for k in ("depth", "top_k", "total_tokens")]


def test_bench_targets_say_met_missed_or_not_measured():
    bench = _bench_module()

    def row(method, tps, accept=None):
        return {"mode": "greedy", "method": method, "tokens_per_s": tps, "speedup": tps / 100,
                "mean_accept_length": accept}

    rows = [row("generate", 100), row("eagle_tree", 150, 3.6), row("eagle3_tree", 180, 3.8),
            row("eagle3_tree_compiled", 260, 3.8), row("prompt_lookup", 200),
            {"mode": "greedy", "method": "assisted", "error": "RuntimeError: boom"},
            row("eagle3_chain", 999, 9.0), {**row("eagle3_tree", 999, 9.0), "mode": "sample"}]
    checks = {c["target"].split(" (")[0]: c for c in bench.targets(rows, "cuda")}
    assert checks["EAGLE-3 mean acceptance length >= 3.5"]["met"] is True
    assert checks["EAGLE-3 acceptance above EAGLE's"]["met"] is True
    speed = checks["speed-up over generate >= 2.5x"]
    assert (speed["value"], speed["met"]) == (2.6, True) and "eagle3_tree_compiled" in speed["target"]
    assert checks["faster than HF prompt lookup"]["met"] is True
    assert checks["faster than HF assisted generation"]["met"] is None  # its row failed: not measured, not met
    slow = {c["target"].split(" (")[0]: c for c in bench.targets(rows[:3] + rows[4:5], "cpu")}
    assert slow["speed-up over generate >= 2.0x"]["met"] is False  # 1.8x from the eager tree alone
    assert slow["faster than HF prompt lookup"]["met"] is False


def test_bench_records_a_failing_method_and_goes_on(built, tmp_path, monkeypatch):
    bench = _bench_module()
    real = bench.run_method

    def run_method(zoo_model, method, *a, **k):
        if method == "eagle_tree":
            raise RuntimeError("boom")
        return real(zoo_model, method, *a, **k)

    monkeypatch.setattr(bench, "run_method", run_method)
    out = tmp_path / "bench.json"
    result = bench.main(["--zoo-dir", str(built[0] / "code-tiny"), "--prompts", "1", "--max-new-tokens", "4",
                         "--modes", "greedy", "--methods", "generate", "eagle_tree", "eagle3_chain",
                         "--chain-depth", "2", "--out", str(out)])
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert [r["method"] for r in saved["rows"]] == ["generate", "eagle_tree", "eagle3_chain"]
    assert saved["rows"][1] == {"mode": "greedy", "method": "eagle_tree", "error": "RuntimeError: boom"}
    assert result["rows"][2]["matches_generate"] is True


def test_demo_uses_the_zoo_model(built, monkeypatch, capsys):
    from eagle_mm.cli.main import main

    monkeypatch.setenv(zoo.ZOO_ENV, str(built[0]))
    assert main(["demo", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "code-tiny" in out and "TOY BUILD" in out and "completion (8 tokens):" in out
    assert "identical: True" in out and "speed-up:" in out and "accept rate per position: [" in out


def test_demo_says_when_it_falls_back_to_a_random_model(tmp_path, monkeypatch, capsys):
    from eagle_mm.cli.main import main

    monkeypatch.setenv(zoo.ZOO_ENV, str(tmp_path))
    assert main(["demo", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "no trained reference model" in out and "RANDOM" in out and "identical: True" in out
