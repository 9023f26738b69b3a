"""transformers', accelerate's and torch's private names are read in one place: the adapter, eagle_mm/hf/.

``PRIVATE`` lists every such name the adapter uses. A test fails when one of them, or any other private name of a
dependency, appears outside the adapter: it then belongs in the adapter (with a line here), not beside the code
that needs it.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "eagle_mm"
ADAPTER = ROOT / "hf"

# name -> whose it is and what it holds
PRIVATE = {
    "_pad_token_tensor": "transformers GenerationConfig: the pad id generate() settled on",
    "_attn_implementation": "transformers PretrainedConfig: the attention implementation",
    "hf_device_map": "accelerate: the device a device_map put each module on",
    "_hf_hook": "accelerate: a module's hook, with its execution device",
    "_shared_state": "accelerate AcceleratorState: the process-wide state",
    "_reset_state": "accelerate AcceleratorState: drops that state",
    "_mixed_precision": "accelerate AcceleratorState: the precision fixed in that state",
    "StaticLayer": "transformers cache_utils: a fixed-size cache layer",
    "cumulative_length": "transformers StaticLayer: its write pointer",
    "max_cache_len": "transformers StaticLayer: its slots",
    "is_initialized": "transformers StaticLayer: whether a forward allocated it",
    "_dynamo": "torch: the graph tracer (static address marks, ahead-of-time compiles, the guard filter)",
    "_dynamo_static_input_type": "torch: the mark of a static address",
    "_inductor": "torch: the compiler's mode options and cache folder",
    "_forward_pre_hooks": "torch Module: its forward pre-hooks",
    "_forward_hooks": "torch Module: its forward hooks",
    "_global_forward_pre_hooks": "torch: the pre-hooks every module runs",
    "_global_forward_hooks": "torch: the hooks every module runs",
}

# Private names of the standard library, allowed anywhere.
STDLIB = {"_SubParsersAction"}  # argparse's type of add_subparsers()' result

_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")
_PRIVATE_MODULE = re.compile(r"^(torch|transformers|accelerate)(\.\w+)*\._[a-z]")


def _files(inside: bool) -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if (ADAPTER in p.parents) == inside)


def _own_names() -> set[str]:
    """Every name eagle_mm defines itself outside the adapter: functions, classes, attributes it assigns, arguments."""
    names = set()
    for path in _files(inside=False):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return names


def _names_used(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every attribute, name, attribute named in getattr() and the like, listed private name in a
    string, and imported module in ``path``."""
    used = []
    tree = ast.parse(path.read_text())
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if id(node) in in_fstrings:
            continue
        if isinstance(node, ast.Attribute):
            used.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name):
            used.append((node.lineno, node.id))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in _ATTRIBUTE_CALLS and len(node.args) > 1:
            name = node.args[1]  # getattr(obj, "_name"): an attribute read by its name
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                used.append((node.lineno, name.value))
        elif isinstance(node, ast.Constant) and node.value in PRIVATE:
            used.append((node.lineno, node.value))
        elif isinstance(node, ast.ImportFrom) and node.module:
            used.append((node.lineno, node.module))
            used += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            used += [(node.lineno, alias.name) for alias in node.names]
    return used


def _offences(path: Path, own: set[str]) -> list[str]:
    where = path.relative_to(ROOT.parent) if ROOT in path.parents else path.name
    bad = []
    for line, name in _names_used(path):
        listed = name in PRIVATE
        foreign = name.startswith("_") and not name.startswith("__") and name not in own and name not in STDLIB
        if listed or foreign or _PRIVATE_MODULE.match(name):
            bad.append(f"{where}:{line}: {name}")
    return bad


def test_no_private_name_outside_the_adapter():
    own = _own_names() - set(PRIVATE)
    bad = [b for path in _files(inside=False) for b in _offences(path, own)]
    assert not bad, "private names of transformers, accelerate or torch outside eagle_mm/hf/:\n" + "\n".join(bad)


def test_the_list_is_what_the_adapter_uses():
    """Every listed name is used in the adapter (a name it no longer needs leaves the list)."""
    used = {name for path in _files(inside=True) for _, name in _names_used(path)}
    assert not set(PRIVATE) - used, f"listed but not used in eagle_mm/hf/: {sorted(set(PRIVATE) - used)}"


def test_the_scan_finds_a_private_name(tmp_path):
    """The scan itself: a private attribute, a listed name in a string and a private module are each found."""
    src = tmp_path / "probe.py"
    src.write_text("import torch._inductor.config\nx = model.config._attn_implementation\n"
                   "y = getattr(m, 'hf_device_map')\nz = cache._seen_tokens\n")
    found = {b.split(": ")[1] for b in _offences(src, own={"model", "cache", "m", "x", "y", "z", "getattr"})}
    assert found == {"torch._inductor.config", "_attn_implementation", "hf_device_map", "_seen_tokens"}, found
