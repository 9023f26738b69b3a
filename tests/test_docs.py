"""The documentation: its Python examples run against the current API, and the site builds with no warning.

A page's ```python blocks run in order, in one namespace, like a reader pasting them into one session.
Blocks that name a path the reader must fill in ("path/to") cannot run here; they must still parse, and
every name they define must be one the fixture stands in for (a tiny random target, a tokenizer built
locally, an untrained head), so the blocks after them run on the fixture's objects.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eagle_mm as em
from tests.local_models import tiny_tokenizer
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_PAGES = ["quickstart.md", "trees.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_PLACEHOLDER = "path/to"


def _blocks(page: str) -> list[str]:
    return _BLOCK.findall((DOCS / page).read_text(encoding="utf-8"))


def _defined_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _fixture() -> dict:
    """What the placeholder blocks would define, on a tiny model."""
    model = tiny_model("llama")
    return {"model": model, "tokenizer": tiny_tokenizer(), "head": em.Eagle3Head.from_target(model), "device": "cpu"}


@pytest.mark.parametrize("page", RUN_PAGES)
def test_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    blocks = _blocks(page)
    if page == "quickstart.md":
        assert len(blocks) >= 8, "the quickstart lost its examples"
    monkeypatch.chdir(tmp_path)  # examples that save heads write here
    torch.manual_seed(0)
    fixture = _fixture()
    # Pages after the quickstart assume its model, tokenizer and head are loaded.
    namespace: dict = {"__name__": "__docs__", **fixture}
    for i, code in enumerate(blocks):
        name = f"{page} python block {i + 1}"
        tree = ast.parse(code, filename=name)
        if _PLACEHOLDER not in code:
            exec(compile(tree, name, "exec"), namespace)
            continue
        # Run the placeholder block's imports; the fixture stands in for what it loads.
        imports = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
        unknown = _defined_names(tree) - _defined_names(imports) - set(fixture)
        assert not unknown, f"{name} defines {sorted(unknown)}, which tests/test_docs.py's fixture does not provide"
        exec(compile(imports, name, "exec"), namespace)
        namespace.update(fixture)
    capsys.readouterr()


def test_quickstart_greedy_example_matches_generate(tmp_path, monkeypatch):
    """The quickstart promises ``torch.equal(out.sequences, reference)`` prints True; hold it to that."""
    monkeypatch.chdir(tmp_path)
    greedy = next(b for b in _blocks("quickstart.md") if "reference = model.generate" in b)
    namespace = {"torch": torch, "eagle_mm": em, **_fixture()}
    exec(greedy.replace("print(torch.equal(out.sequences, reference))", "_same = torch.equal(out.sequences, reference)"),
         namespace)
    assert namespace["_same"]


def test_every_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav is built but unreachable: list it (mkdocs --strict misses this)."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), f"add these docs pages to the nav in mkdocs.yml: {sorted(pages - listed)}"
    assert listed - pages == set(), f"mkdocs.yml's nav lists missing pages: {sorted(listed - pages)}"


def test_tree_figure_is_committed_and_small():
    png = DOCS / "assets" / "tree.png"
    assert png.is_file(), "run python docs/assets/make_tree_figure.py"
    assert png.stat().st_size < 200 * 1024


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


_HAVE_MKDOCS = _have("mkdocs") and _have("mkdocstrings_handlers.python")


@pytest.mark.skipif(not _HAVE_MKDOCS, reason='mkdocs is not installed: pip install -e ".[docs]" (CI builds the site '
                    "in its own docs step)")
def test_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()


# ---- docs/byom.md, on a tiny stand-in ------------------------------------------------------------------------
_BASH = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_BYOM_TOKENS = 8  # the page asks for 256 new tokens of an 8B model; the stand-in's are as telling at 8


def _commands(block: str) -> list[list[str]]:
    import shlex

    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _stand_in(root: Path, download: list[list[str]]) -> None:
    """A tiny target and head in the folders the page's download block writes (no 8B model runs offline)."""
    from tests.local_models import save_local_checkpoints

    target, head = save_local_checkpoints(root / "stand-in")
    folders = [c[c.index("--local-dir") + 1] for c in download if "--local-dir" in c]
    assert len(folders) == 2 and "EAGLE3" in folders[1], folders
    (root / folders[0]).parent.mkdir(parents=True, exist_ok=True)
    target.rename(root / folders[0])
    head.rename(root / folders[1])


def test_byom_page_runs_on_a_tiny_stand_in(tmp_path, monkeypatch, capsys):
    """docs/byom.md top to bottom, with a tiny random target and an untrained head standing in for the 8B pair its
    download block fetches: every other block runs as written (new tokens cut to 8), through the CLI and Python."""
    from eagle_mm.cli.main import main

    page = (DOCS / "byom.md").read_text(encoding="utf-8")
    assert "device_map=\"cuda\"" not in page
    blocks = [_commands(b) for b in _BASH.findall(page)]
    download = blocks[0]
    assert download[0] == ["hf", "auth", "login"] and all(c[:2] == ["hf", "download"] for c in download[1:])
    monkeypatch.chdir(tmp_path)
    _stand_in(tmp_path, download)
    ran = []
    for commands in blocks[1:]:
        for argv in commands:
            assert argv[0] == "eagle-mm", argv
            argv = [str(_BYOM_TOKENS) if prev == "--max-new-tokens" else a for prev, a in zip([""] + argv, argv)]
            assert main(argv[1:]) == 0, (argv, capsys.readouterr())
            ran.append(argv[1])
    assert ran == ["generate", "generate", "bench", "export"], ran
    out = capsys.readouterr().out
    assert "greedy outputs: identical" in out and "vllm serve models/Llama-3.1-8B-Instruct" in out, out
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "exported" / "vllm" / "config.json").is_file()
    (python,) = _blocks("byom.md")
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(python.replace("max_new_tokens=256", f"max_new_tokens={_BYOM_TOKENS}"), "byom.md python", "exec"),
         namespace)
    assert namespace["out"].stats.mean_accept_length >= 1.0 and namespace["device"] == "cpu"


def test_the_real_model_page_states_the_shipped_manifest():
    """docs/reference-models.md's figures for smollm2-135m-instruct are the shipped manifest's and recipe.json's."""
    import json

    page = " ".join((DOCS / "reference-models.md").read_text(encoding="utf-8").split())
    manifest = json.loads((ROOT / "eagle_mm/zoo/models/smollm2-135m-instruct/manifest.json").read_text("utf-8"))
    recipe = json.loads((ROOT / "scripts/smollm2/recipe.json").read_text(encoding="utf-8"))
    for mode in ("greedy", "sampled"):
        for name, row in manifest["measured"][mode]["sets"].items():
            label = {"humaneval": "HumanEval", "chat": "chat"}[name]
            stated = f"| {label} | {row['prompts']} of {row['of']} | {row['mean_accept_length']:.2f} |"
            assert stated in page, f"the page does not state {mode} {name} as the manifest has it: {stated}"
    assert f"{manifest['train']['steps']} steps at batch {recipe['train']['batch_size']}" in page
    assert f"batches of {recipe['regenerate']['batch_size']:,}" in page
    training = " ".join((DOCS / "training.md").read_text(encoding="utf-8").split())
    assert f"(the SmolLM2 recipe, [Reference models](reference-models.md), uses {recipe['regenerate']['batch_size']})" \
        in training
