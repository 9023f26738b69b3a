"""No import cycle among eagle_mm's modules, counting imports inside functions too (read from the source)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_mm"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its source (``from . import x`` counts as x)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
            found.update(subs if len(subs) == len(node.names) else subs + [target])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in mods and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert "eagle_mm.decode.loop" in graph and graph["eagle_mm.decode.loop"]  # the scan sees imports
    assert _cycles(graph) == []


def test_a_cycle_is_found():
    """The check itself: a planted cycle is reported."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_layers_point_down():
    """The library never imports its command line (the ``__main__`` entry points excepted); the lowest decode layer
    (trees, masks, acceptance, sampling) imports nothing above it; the kernels import nothing of decode."""
    graph = _graph()
    to_cli = {m: sorted(d for d in deps if d.startswith("eagle_mm.cli")) for m, deps in graph.items()
              if not m.startswith("eagle_mm.cli") and not m.endswith("__main__")}
    assert not {m: d for m, d in to_cli.items() if d}, "library modules import eagle_mm.cli"
    kernels = {"eagle_mm.kernels", "eagle_mm.kernels.dispatch", "eagle_mm.kernels.reference"}
    lowest = {"eagle_mm.decode.tree": set(), "eagle_mm.decode.masks": set(),
              "eagle_mm.decode.sampling": kernels | {"eagle_mm.decode.tree"},
              "eagle_mm.decode.accept": kernels | {"eagle_mm.decode.tree", "eagle_mm.decode.sampling"}}
    for module, allowed in lowest.items():
        assert graph[module] <= allowed, f"{module} imports {sorted(graph[module] - allowed)}"
    for module, deps in graph.items():
        if module.startswith("eagle_mm.kernels"):
            assert not {d for d in deps if d.startswith("eagle_mm.decode")}, module


# The one module-level table allowed in decode: an index of weak references from a model to the heads that decoded
# with it, for eagle_mm.release(model); it holds no state of the engine's (that lives on the decoders).
_INDEXES = {"decoder.py: _HEADS_OF"}
_MUTABLE = ("dict", "list", "set", "OrderedDict", "defaultdict", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet")


def _registries(path: Path) -> list[str]:
    """Module-level names bound to an empty mutable container: a registry filled at run time."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        empty = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not (
            value.keys if isinstance(value, ast.Dict) else value.elts)
        if isinstance(value, ast.Call):
            name = getattr(value.func, "attr", getattr(value.func, "id", ""))
            empty = name in _MUTABLE and not value.args
        if empty:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{path.name}:{node.lineno}: {ast.unparse(t)}" for t in targets]
    return found


def test_no_module_level_registries_in_decode():
    """Decode state lives on the decoder object (``eagle_mm.decoder``), not in module-level tables."""
    found = [r for p in sorted((PACKAGE / "decode").glob("*.py")) for r in _registries(p)]
    assert {f"{r.split(':')[0]}: {r.split(': ')[1]}" for r in found} <= _INDEXES, found


def test_a_registry_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import weakref\nA = {}\nB: dict = {}\nC = weakref.WeakKeyDictionary()\nD = {'x': 1}\nE = ()\n")
    assert [r.split(": ")[1] for r in _registries(probe)] == ["A", "B", "C"]


def test_bench_and_scripts_do_not_import_tests():
    """bench/ and scripts/ run on their own: they never import the test suite (nor load its files)."""
    root = PACKAGE.parent
    bad = []
    for path in sorted([*(root / "bench").glob("*.py"), *(root / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value in ("tests", "tests/") else []
            bad += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n == "tests" or
                    n.startswith(("tests.", "tests/"))]
    assert not bad, bad
