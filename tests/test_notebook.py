"""notebooks/quickstart.ipynb runs top to bottom on CPU (nbclient), and says what it promises.

The notebook is committed without outputs; this test executes a copy twice in a row in one temporary folder (where
it writes its data file, trained head and export: the second run finds the first one's files, as a user re-running
it does) and checks the outputs of the cells that compare, plot, train and export, in both runs.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason='pip install -e ".[test]" (nbformat, nbclient, ipykernel)')
nbclient = pytest.importorskip("nbclient", reason='pip install -e ".[test]" (nbformat, nbclient, ipykernel)')
pytest.importorskip("ipykernel", reason='pip install -e ".[test]" (ipykernel runs the notebook)')
pytest.importorskip("matplotlib", reason='pip install -e ".[test]" (matplotlib draws the plots)')

from eagle_mm import zoo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
BUDGET_S = 90  # the notebook promises "about a minute on a CPU"


def _read():
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_committed_without_outputs():
    nb = _read()
    nbformat.validate(nb)
    stored = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not stored, f"clear the outputs of code cells {stored} (jupyter nbconvert --clear-output --inplace)"


def _text(cell) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output and "text/plain" in output.data:
            parts.append(output.data["text/plain"])
    return "".join(parts)


def _cell(nb, needle: str):
    return next(c for c in nb.cells if c.cell_type == "code" and needle in c.source)


def _run(work: Path):
    """Execute a fresh copy of the notebook in ``work``: (the executed notebook, seconds)."""
    nb = _read()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           # the suite's one-thread policy (tests/conftest.py), and the plot rendered without a display
           "OMP_NUM_THREADS": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        start = time.perf_counter()
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                resources={"metadata": {"path": str(work)}}).execute()
        seconds = time.perf_counter() - start
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb, seconds


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if not zoo.is_available("code-tiny"):
        pytest.skip("the code-tiny reference model is not built (see docs/reference-models.md)")
    return tmp_path_factory.mktemp("notebook")


# Two module fixtures, not one loop, so that each run is set up by its own test and keeps its own time limit.
@pytest.fixture(scope="module")
def first_run(folder):
    nb, seconds = _run(folder)
    return nb, folder, seconds


@pytest.fixture(scope="module")
def second_run(folder, first_run):
    """The notebook again in the same folder, which now holds the first run's files."""
    nb, seconds = _run(folder)
    return nb, folder, seconds


@pytest.fixture(params=("first_run", "second_run"))
def executed(request):
    """(executed notebook, its folder, seconds), for each run."""
    return request.getfixturevalue(request.param)


def test_notebook_runs_within_budget(executed):
    _, _, seconds = executed
    assert seconds < BUDGET_S, f"the notebook took {seconds:.0f} s; it promises about a minute on a CPU"


def test_progress_bars_draw_without_a_warning(executed):
    pytest.importorskip("ipywidgets", reason='pip install -e ".[test]" (ipywidgets draws the progress bars)')
    warned = [_text(c) for c in executed[0].cells if c.cell_type == "code" and "TqdmWarning" in _text(c)]
    assert not warned, warned


def test_speculative_matches_generate(executed):
    nb = executed[0]
    text = _text(_cell(nb, "reference = target.generate"))
    assert "greedy outputs: identical" in text, text
    assert "mean accept length:" in text


def test_benchmark_table_and_plot(executed):
    nb = executed[0]
    table = _text(_cell(nb, "run_benchmark("))
    assert "generate" in table and "eagle3" in table and "tok/s" in table, table
    plot = _cell(nb, "plt.subplots")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "the plot cell drew no figure"


def test_training_wrote_a_head(executed):
    nb, work, _ = executed
    text = _text(_cell(nb, "trained = train(config)"))
    assert "mean acceptance length on held-out rows:" in text, text
    assert (work / "heads" / "my-head" / "config.json").is_file()
    assert len(json.loads((work / "heads" / "my-head" / "train_config.json").read_text())) > 10


def test_export_has_the_vllm_layout(executed):
    nb, work, _ = executed
    text = _text(_cell(nb, "export_head(head"))
    assert "exported files: ['config.json', 'model.safetensors']" in text, text
    assert "round trip exact: True" in text and "trained head against generate: identical" in text
    assert "vllm serve" in text
    config = json.loads((work / "exported" / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_mm_export"]["layout"] == "vllm"
