"""The quickstart's walk-through, run as a new user runs it: its marked shell blocks, in order, in one shell.

docs/quickstart.md marks the blocks of its walk-through with ``<!-- walkthrough -->``; this test runs exactly
those blocks (no copy of the commands lives here, so the page and the test cannot drift apart) in an empty
folder and then a second time in the same folder (as a user re-running the page does), through the ``eagle-mm``
console script, and checks what each step promises: identical greedy tokens,
a trained head, an exported one in the vLLM layout, a benchmark table. ``eagle-mm`` and ``python`` are this
interpreter (a shim on PATH) and the checkout is on PYTHONPATH, so the test exercises this source tree the way
``pip install -e .`` would expose it.
"""
from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_mm import zoo

# One walk is about four minutes on a busy 2-core CPU; the test that sets it up gets room for it.
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"
_MARKED = re.compile(r"^<!-- walkthrough -->\n```bash\n(.*?)^```", re.M | re.S)
_STEP = "### walkthrough step {} ###"


def _marked_blocks() -> list[str]:
    return _MARKED.findall(PAGE.read_text(encoding="utf-8"))


def test_the_walkthrough_is_marked():
    blocks = _marked_blocks()
    assert len(blocks) >= 5, "docs/quickstart.md lost its <!-- walkthrough --> blocks"
    text = "\n".join(blocks)
    for command in ("eagle-mm generate", "eagle-mm train", "eagle-mm export", "--layout vllm", "eagle-mm bench"):
        assert command in text, f"the walk-through no longer runs {command!r}"


def test_the_stated_time_is_a_measurement():
    """The page states what the walk took where it was measured, not a hope."""
    page = PAGE.read_text(encoding="utf-8")
    intro = page.split("## Walk-through", 1)[1].split("<!-- walkthrough -->", 1)[0]
    assert re.search(r"Measured: \d+ s .*2-core CPU", " ".join(intro.split())), intro
    assert "about a minute" not in intro


def test_the_install_gives_the_console_script():
    """The walk-through starts after `pip install -e .`: that is what puts `eagle-mm` on PATH."""
    page = PAGE.read_text(encoding="utf-8")
    assert "pip install -e ." in page
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = setup["options.entry_points"]["console_scripts"]
    assert re.search(r"^\s*eagle-mm = eagle_mm\.cli:main\s*$", scripts, re.M), scripts


def _shims(folder: Path) -> Path:
    """`eagle-mm` and `python` on PATH, both this interpreter (and so this checkout, via PYTHONPATH)."""
    folder.mkdir()
    for name, line in (("eagle-mm", f'exec "{sys.executable}" -m eagle_mm "$@"'),
                       ("python", f'exec "{sys.executable}" "$@"')):
        shim = folder / name
        shim.write_text(f"#!/bin/sh\n{line}\n", encoding="utf-8")
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return folder


def _walk(script: str, work: Path, env: dict, count: int) -> dict[int, str]:
    """Run the blocks once in ``work``: {step number: its stdout + stderr}."""
    result = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=560)
    output = result.stdout
    assert result.returncode == 0, f"the walk-through failed:\n{output[-6000:]}"
    parts = re.split(r"^### walkthrough step (\d+) ###$", output, flags=re.M)
    steps = {int(n): text for n, text in zip(parts[1::2], parts[2::2])}
    assert sorted(steps) == list(range(count))
    return steps


@pytest.fixture(scope="module")
def walk_setup(tmp_path_factory):
    """(the script of the marked blocks, the empty folder to run it in, its environment, the blocks)."""
    if not zoo.is_available("code-tiny"):
        pytest.skip("the code-tiny reference model is not built (see docs/reference-models.md)")
    if shutil.which("bash") is None:
        pytest.skip("the walk-through is bash")
    base = tmp_path_factory.mktemp("walkthrough")
    work = base / "work"
    work.mkdir()
    blocks = _marked_blocks()
    # stderr joins stdout, so that each step's logs land in its part of the output
    script = "set -euo pipefail\nexec 2>&1\n" + "".join(f"echo '{_STEP.format(i)}'\n{b}" for i, b in enumerate(blocks))
    env = dict(os.environ, PATH=f"{_shims(base / 'bin')}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")  # the suite's one-thread policy (tests/conftest.py)
    env.pop(zoo.ZOO_ENV, None)  # the shipped model, as a new user has it
    return script, work, env, blocks


def _walk_in(setup) -> tuple:
    script, work, env, blocks = setup
    return work, _walk(script, work, env, len(blocks)), blocks


# Two module fixtures, not one loop, so that each walk is set up by its own test and keeps its own time limit.
@pytest.fixture(scope="module")
def first_walk(walk_setup):
    return _walk_in(walk_setup)


@pytest.fixture(scope="module")
def second_walk(walk_setup, first_walk):
    """The same blocks again in the same folder, which now holds the first walk's files."""
    return _walk_in(walk_setup)


@pytest.fixture(params=("first_walk", "second_walk"))
def walked(request):
    """(the folder the blocks ran in, {step number: its stdout + stderr}, the blocks), for each walk."""
    return request.getfixturevalue(request.param)


def _step(walked, needle: str) -> str:
    _, steps, blocks = walked
    found = [i for i, b in enumerate(blocks) if needle in b]
    assert found, f"no walk-through block runs {needle!r}"
    return steps[found[0]]


def test_generate_with_the_shipped_model(walked):
    out = _step(walked, '--head "$MODEL/eagle3" --prompt')
    assert "greedy outputs: identical" in out, out  # float32 on a CPU: token for token
    assert "Traceback" not in out and "Loading weights" not in out, out
    assert "mean accept length:" in out and "accept rate per position: [" in out and "speed-up:" in out
    assert "tree: depth=" in out  # no tree options: the default call's tree for the device, printed


def test_training_data_is_written(walked):
    rows = [json.loads(line) for line in (walked[0] / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 4 and all(set(r) == {"text"} and r["text"] for r in rows)


def test_a_drafter_is_trained(walked):
    head = walked[0] / "heads" / "my-head"
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    evaluation = json.loads((head / "eval.json").read_text(encoding="utf-8"))
    assert evaluation["mean_accept_length"] >= 1.0
    assert "mean acceptance length" in _step(walked, "eagle-mm train")  # the trainer's closing log line


def test_the_trained_drafter_generates(walked):
    out = _step(walked, "--head heads/my-head --prompt")
    assert "greedy outputs: identical" in out, out


def test_the_drafter_is_exported_for_vllm(walked):
    out = _step(walked, "eagle-mm export")
    assert "in the vllm layout to exported/vllm" in out and "vllm serve " in out, out
    exported = walked[0] / "exported" / "vllm"
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((exported / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_mm_export"]["layout"] == "vllm"


def test_the_benchmark_prints_its_table(walked):
    out = _step(walked, "eagle-mm bench")
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] and line.split()[0] in ("generate", "eagle", "eagle3")}
    assert set(rows) == {"generate", "eagle", "eagle3"}, out
    for name in ("eagle", "eagle3"):
        assert rows[name][4] == "yes", rows[name]  # identical to generate
        assert float(rows[name][3]) > 1.5, rows[name]  # mean acceptance length of a trained head
