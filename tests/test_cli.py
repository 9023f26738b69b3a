"""The `eagle-mm` command line, run in-process."""

import pytest

from eagle_mm.cli import main


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--help"])
    assert excinfo.value.code == 0
    assert "demo" in capsys.readouterr().out


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
