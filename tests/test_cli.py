"""The `eagle-mm` command line, run in-process."""

import pytest

from eagle_mm.cli import main


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "generate" in out and "export" in out


def test_demo_speculative_matches_generate(capsys):
    status = main(["demo", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "identical: True" in out
    assert "mean accept length:" in out
    assert "accept rate per position: [" in out
    assert "target forwards:" in out


def test_demo_compiled_matches_generate(capsys):
    status = main(["demo", "--max-new-tokens", "8", "--compile"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "static cache, compiled" in out and "identical: True" in out


@pytest.mark.parametrize("extra", (["--random"], ["--image"]))
def test_demo_compile_is_for_the_code_model(capsys, extra):
    assert main(["demo", "--compile", *extra]) == 2
    assert "--compile applies to the code reference model" in capsys.readouterr().err


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
    assert "greedy outputs match: True" in out


def test_generate_passes_tree_options(capsys, local_dirs):
    status, out, err = _generate(capsys, *local_dirs, "--max-new-tokens", "6", "--depth", "3", "--top-k-tree", "1",
                                 "--total-tokens", "3")
    assert status == 0, err
    assert "tree: depth=3, top_k=1, total_tokens=3" in out
    rates = out.split("accept rate per position: [")[1].split("]")[0]
    assert len(rates.split(",")) == 3


def test_generate_sampling_is_seeded(capsys, local_dirs):
    sampling = ("--max-new-tokens", "10", "--do-sample", "--temperature", "1.5", "--top-p", "0.95", "--seed", "7")
    runs = [_generate(capsys, *local_dirs, *sampling, *extra) for extra in ((), ("--compare",))]
    for status, _, err in runs:
        assert status == 0, err
    texts = [out.split("\n\ntree:")[0] for _, out, _ in runs]
    assert texts[0] == texts[1]
    assert "greedy outputs match: n/a" in runs[1][1]


@pytest.mark.parametrize("which", ["--target", "--head"])
def test_generate_names_a_missing_directory(capsys, local_dirs, tmp_path, which):
    target, head = local_dirs
    missing = tmp_path / "nowhere"
    args = (missing, head) if which == "--target" else (target, missing)
    status, _, err = _generate(capsys, *args)
    assert status == 2
    assert f"no such directory: {missing}; pass {which} a local" in err


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
                "speculative_s": 0.5, "speedup": 2.0}

    fake = types.ModuleType("eagle_mm.zoo.scenes_tiny")
    fake.image_demo = image_demo
    monkeypatch.setitem(sys.modules, "eagle_mm.zoo.scenes_tiny", fake)
    monkeypatch.setattr(zoo, "scenes_tiny", fake, raising=False)
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG")
    assert main(["demo", "--image", str(image), "--max-new-tokens", "5", "--depth", "3"]) == 0
    assert calls and calls[0]["image"] == str(image) and calls[0]["max_new_tokens"] == 5
    assert calls[0]["tree"].depth == 3 and "question" not in calls[0]
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
    (["--target", "{target}", "--head", "{head}", "--prompt", "Hi", "--kind", "eagle"], "--zoo-dir and --kind pick"),
    (["--zoo-dir", "{missing}"], "no such directory: {missing}; pass --zoo-dir"),
])
def test_bench_explains_bad_arguments(capsys, local_dirs, tmp_path, args, message):
    paths = {"target": local_dirs[0], "head": local_dirs[1], "missing": tmp_path / "nowhere"}
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


def test_demo_image_without_a_path_renders_a_scene(monkeypatch, capsys):
    import sys
    import types

    from eagle_mm import zoo

    calls = []

    def image_demo(**kwargs):
        calls.append(kwargs)
        return {"question": "Describe the image.", "completion": "A red circle.", "identical": True,
                "mean_accept_length": 2.5, "accept_rate_per_position": [0.5], "generate_s": 1.0,
                "speculative_s": 0.5, "speedup": 2.0}

    fake = types.ModuleType("eagle_mm.zoo.scenes_tiny")
    fake.image_demo = image_demo
    monkeypatch.setitem(sys.modules, "eagle_mm.zoo.scenes_tiny", fake)
    monkeypatch.setattr(zoo, "scenes_tiny", fake, raising=False)
    assert main(["demo", "--image"]) == 0
    assert calls[0]["image"] is None  # image_demo's default: a rendered validation scene
    assert "image: a rendered validation scene (seed 0)" in capsys.readouterr().out
