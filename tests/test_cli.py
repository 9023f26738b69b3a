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
