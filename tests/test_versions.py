"""The supported transformers range is stated once, in setup.cfg: the docs and CI take it from there, and the tests
run on a release inside it."""
import configparser
import re
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def supported_range() -> tuple[str, str, str]:
    """setup.cfg's transformers requirement, its oldest release and its bound (``>=5.17,<5.26``: 5.17 to 5.25)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = [r.strip() for r in cfg["options"]["install_requires"].splitlines()]
    (req,) = [r for r in reqs if r.startswith("transformers")]
    match = re.fullmatch(r"transformers>=(\d+\.\d+),<(\d+\.\d+)", req)
    assert match, f"setup.cfg asks for {req!r}; state the tested range as transformers>=OLDEST,<BOUND"
    return req, match.group(1), match.group(2)


@pytest.mark.compat
def test_the_docs_state_the_range_of_setup_cfg():
    req, oldest, bound = supported_range()
    major, minor = map(int, bound.split("."))
    newest = f"{major}.{minor - 1}"  # the bound is the first release not tested
    text = " ".join((ROOT / "docs" / "how-it-works.md").read_text().split())
    assert f"transformers {oldest} to {newest} (`{req}` in setup.cfg" in text


@pytest.mark.compat
def test_ci_takes_the_range_from_setup_cfg():
    script = (ROOT / ".ci" / "run").read_text()
    assert not re.search(r"transformers==\d", script), ".ci/run names a transformers release; read it from setup.cfg"
    assert "setup.cfg" in script


@pytest.mark.compat
def test_the_installed_transformers_is_in_the_supported_range():
    _, oldest, bound = supported_range()
    installed = Version(transformers.__version__)
    assert Version(oldest) <= installed < Version(bound), (
        f"transformers {installed} is outside the tested range {oldest} to <{bound} (setup.cfg): test it, then "
        "move the bound")
