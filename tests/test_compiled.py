"""decode/compiled.py: the compiled steps saved whole and loaded by a second process, end to end (real compiles on
the CPU, in subprocesses), then its bookkeeping with torch's compiler and loader replaced by stand-ins."""
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import eagle_mm.decode.compiled as compiled
from eagle_mm.decode.compiled import DiskCompiled


_CHILD = """
import json, sys, torch
import eagle_mm as em
from eagle_mm.decode import steps as step_module
from eagle_mm.decode.bound import bound_head
from eagle_mm.decode.graphs import _WRAPPED
from tests.tiny import prompt, tiny_model
def module_names():  # names dynamo adds to a traced function's module while tracing (numbered per process)
    return sorted(k for k in vars(step_module) if k.startswith("__"))
result, imported = {}, module_names()
for name, seed in json.loads(sys.argv[1]):
    model = tiny_model("llama", seed=seed, num_hidden_layers=2)
    head = em.Eagle3Head.from_target(model, aux_layers=(0, 1, 2))
    out = em.speculative_generate(model, head, prompt(8), max_new_tokens=6, compile="default",
                                  tree=em.TreeConfig.chain(2), return_dict_in_generate=True)
    ref = model.generate(prompt(8), max_new_tokens=6, do_sample=False)
    steps = [f for owner in (model, bound_head(model, head, model.dtype)) for f in _WRAPPED[owner].values()]
    result[name] = {"equal": torch.equal(out.sequences, ref), "loaded": sum(f.loaded for f in steps),
                    "compiled": sum(f.compiled for f in steps)}
result["module_unchanged"] = module_names() == imported
print("RESULT", json.dumps(result))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_steps(tmp_path):
    """compile=True/a mode: the compiled steps are saved whole under TORCHINDUCTOR_CACHE_DIR/eagle_mm; a second
    process with the same shapes loads them instead of tracing and compiling, for another model of the same config
    too (the weights are the steps' inputs, not baked in), with every output equal to ``generate``'s. Loading adds
    nothing to the steps' module: torch's own precompile cache installed the saving process's numbered names
    there, and a later trace in the loading process that made the same name crashed inside dynamo."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    runs = []
    for models in ([["a", 0]], [["b", 1]]):
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(models)], capture_output=True, text=True,
                              env=env, timeout=280)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert line, proc.stderr[-3000:]
        runs.append(json.loads(line[0][7:]))
    first, second = runs
    # the verify and the update (the steps compile= compiles): compiled and saved, then loaded
    assert first["a"] == {"equal": True, "loaded": 0, "compiled": 2}
    assert second["b"] == {"equal": True, "loaded": 2, "compiled": 0}  # nothing traced or compiled
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "eagle_mm").iterdir()) == ["update_step", "verify_step"]
    assert second["module_unchanged"] and not first["module_unchanged"]  # the compiling process's trace adds them


class FakeCompiled:
    """What ``aot_compile`` and ``load_compiled_function`` return: a function with its guards."""

    def __init__(self, fn, passes=lambda *args: True):
        self.fn, self.passes, self.checks = fn, passes, 0

    def guard_check(self, *args):
        self.checks += 1
        return self.passes(*args)

    def disable_guard_check(self):
        pass

    def __call__(self, *args):
        return self.fn(*args)

    @classmethod
    def serialize(cls, fn):
        return SimpleNamespace(serialized_data=b"saved")


@pytest.fixture
def fake_torch(monkeypatch, tmp_path):
    """torch.compile(...).aot_compile and torch.compiler.load_compiled_function as stand-ins; the files under
    tmp_path. ``made`` lists what was compiled and loaded; set ``load_fails`` or ``loaded_guards`` to misbehave."""
    state = SimpleNamespace(made=[], load_fails=None, loaded_guards=lambda *args: True)

    def compile_(fn, **options):
        assert options["fullgraph"] and options["dynamic"] is False and "guard_filter_fn" in options["options"]

        def aot_compile(example_inputs):
            state.made.append("compiled")
            return FakeCompiled(fn)

        return SimpleNamespace(aot_compile=aot_compile)

    def load(f, f_globals=None):
        assert f.read() == b"saved" and f_globals is step.__globals__
        if state.load_fails:
            raise state.load_fails
        state.made.append("loaded")
        return FakeCompiled(step, state.loaded_guards)

    monkeypatch.setattr(compiled.torch, "compile", compile_)
    monkeypatch.setattr(compiled.torch.compiler, "load_compiled_function", load)
    monkeypatch.setattr(compiled, "cache_folder", lambda: tmp_path)
    return state


def step(owner, x, n: int):
    return owner(x) * n


def test_a_second_process_loads_what_the_first_saved(fake_torch, tmp_path):
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    first = DiskCompiled(step, "step", "default")
    assert torch.equal(first(owner, x, 2), owner(x) * 2)
    assert fake_torch.made == ["compiled"] and len(list(tmp_path.iterdir())) == 1
    second = DiskCompiled(step, "step", "default")  # what a new process builds
    assert torch.equal(second(owner, x, 2), owner(x) * 2)
    assert fake_torch.made == ["compiled", "loaded"] and (second.loaded, second.compiled) == (1, 0)
    DiskCompiled(step, "step", "default")(owner, x, 3)  # another plain value: another file
    assert fake_torch.made[-1] == "compiled" and len(list(tmp_path.iterdir())) == 2


def test_the_key_names_what_unsaved_guards_would_check(fake_torch, tmp_path):
    """Identity guards are not saved: the owner's module classes and hooks, and argument shapes, are in the key."""
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)
    DiskCompiled(step, "step", "default")(owner, torch.randn(3, 4), 2)  # another shape
    handle = owner.register_forward_hook(lambda *args: None)
    DiskCompiled(step, "step", "default")(owner, x, 2)  # a hook the trace would run
    handle.remove()
    DiskCompiled(step, "step", "default")(torch.nn.Sequential(owner), x, 2)  # another module tree
    assert fake_torch.made == ["compiled"] * 4 and len(list(tmp_path.iterdir())) == 4
    DiskCompiled(step, "step", "default")(owner, x, 2)
    assert fake_torch.made[-1] == "loaded"


def test_a_file_that_does_not_load_is_compiled_again_with_a_warning(fake_torch, caplog):
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)
    fake_torch.load_fails = RuntimeError("saved by another torch")
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        out = DiskCompiled(step, "step of Linear", "default")(owner, x, 2)
    assert torch.equal(out, owner(x) * 2) and fake_torch.made == ["compiled", "compiled"]
    assert any("loading the compiled step of Linear" in r.getMessage() and "saved by another torch" in r.getMessage()
               for r in caplog.records)


def test_a_loaded_step_whose_guards_fail_is_compiled_again(fake_torch):
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)
    fake_torch.loaded_guards = lambda *args: False  # a value the trace read differs (the saved guards say so)
    again = DiskCompiled(step, "step", "default")
    again(owner, x, 2)
    assert fake_torch.made == ["compiled", "loaded", "compiled"] and (again.loaded, again.compiled) == (0, 1)


def test_guards_run_once_per_new_argument_objects(fake_torch):
    """Not on every cycle (new tensors of the same shapes): once for new objects, such as a new call's capture."""
    owner = torch.nn.Linear(4, 4)
    stepper = DiskCompiled(step, "step", "default")
    for _ in range(3):
        stepper(owner, torch.randn(2, 4), 2)
    (fn,) = stepper._entries[next(iter(stepper._entries))]
    assert fn.checks == 0  # compiled for these very arguments
    stepper(torch.nn.Linear(4, 4), torch.randn(2, 4), 2)  # a new object: its guards are checked once
    stepper(owner, torch.randn(2, 4), 2)
    assert fn.checks == 1


def test_a_graph_break_compiles_in_the_process_only(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(compiled, "cache_folder", lambda: tmp_path)
    plain = []

    def compile_(fn, **options):
        if options.get("fullgraph"):
            def aot_compile(example_inputs):
                raise RuntimeError("a graph break")
            return SimpleNamespace(aot_compile=aot_compile)
        plain.append(options)
        return fn

    monkeypatch.setattr(compiled.torch, "compile", compile_)
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    stepper = DiskCompiled(step, "step of Linear", "default")
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        assert torch.equal(stepper(owner, x, 2), owner(x) * 2)
        assert torch.equal(stepper(owner, x, 2), owner(x) * 2)
    assert plain == [{"dynamic": False, "mode": "default"}] and not list(tmp_path.iterdir())
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "the step of Linear cannot be compiled ahead of time"]
