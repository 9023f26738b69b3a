"""decode/compiled.py: the compiled steps saved whole and loaded by a second process, end to end (real compiles on
the CPU, in subprocesses), then its bookkeeping with torch's compiler and loader replaced by stand-ins."""
import json
import logging
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import eagle_mm.decode.compiled as compiled
from eagle_mm.decode.compiled import DiskCompiled

REAL_LOAD = torch.compiler.load_compiled_function


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


def test_the_key_names_a_forward_replaced_on_an_instance(fake_torch, tmp_path):
    """A kernel hub's ``kernelize`` replaces ``forward`` on module instances, registered or kept in a dict attribute
    (transformers 5.25's per-layer kernel functions): the guards that would see it are not saved, the key does."""
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    owner.__dict__["_kernel_funcs"] = {"relu2": _local_function_module()}
    DiskCompiled(step, "step", "default")(owner, x, 2)
    owner.__dict__["_kernel_funcs"]["relu2"].forward = lambda x: x
    DiskCompiled(step, "step", "default")(owner, x, 2)
    owner.forward = lambda x: x
    DiskCompiled(step, "step", "default")(owner, x, 2)
    assert fake_torch.made == ["compiled"] * 3 and len(list(tmp_path.iterdir())) == 3


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


def _local_function_module():
    class Func(torch.nn.Module):  # defined in a function, as transformers 5.25's kernel-replaceable functions are
        def forward(self, x):
            return torch.relu(x) * 2

    return Func()


relu2 = _local_function_module()


def local_step(owner, x):
    return relu2(owner(x))


def test_a_step_through_an_object_of_a_local_class_is_saved_and_loaded(monkeypatch, tmp_path):
    """Real compiles: torch cannot save a guard on the type of an object whose class is local (transformers 5.25's
    ``apply_rotary_pos_emb``), and guards through such an object fail at load; both are left to the key, so the
    step is still compiled ahead of time, saved, and loaded."""
    monkeypatch.setattr(compiled, "cache_folder", lambda: tmp_path)
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    first = DiskCompiled(local_step, "step", "default")
    assert torch.allclose(first(owner, x), local_step(owner, x))
    assert (first.compiled, first.loaded, first._plain) == (1, 0, None)
    second = DiskCompiled(local_step, "step", "default")
    assert torch.allclose(second(owner, x), local_step(owner, x))
    assert (second.compiled, second.loaded, second._plain) == (0, 1, None)


# ---- files that are not ours: another user's folder or file, a planted pickle, another step's file -------------
class Planted:
    """A pickle that, when loaded, creates ``marker``: what torch's loader would run from a planted file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _as_another_user(monkeypatch, path) -> None:
    """``path`` belongs to another user: given to uid 12345 when the tests run as root (as in CI's container),
    otherwise this process takes another uid for the ownership checks (the files stay the tester's)."""
    if os.geteuid() == 0:
        os.chown(path, 12345, 12345)
    else:
        monkeypatch.setattr(compiled.os, "geteuid", lambda: os.getuid() + 1)


def _one_file(folder):
    (path,) = folder.iterdir()
    return path


def _cache(monkeypatch, tmp_path):
    folder = tmp_path / "inductor" / "eagle_mm"
    monkeypatch.setattr(compiled, "cache_folder", lambda: folder)
    return folder


@pytest.mark.parametrize("header", [False, True], ids=["bare", "with-header"])
def test_a_planted_file_in_a_world_writable_folder_is_not_run(fake_torch, monkeypatch, tmp_path, caplog, header):
    """The folder another user could write: nothing in it is unpickled (torch's real loader, a payload that would
    create a marker file), whether the file is a bare pickle or carries a well-formed header; one warning names
    the folder, and the step is compiled in this process, not saved."""
    folder = _cache(monkeypatch, tmp_path)
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)
    path, marker = _one_file(folder), tmp_path / "ran"
    payload = pickle.dumps(Planted(marker))
    if header:  # as this library writes it, for the key the good file was saved under
        payload = compiled._pack(json.loads(path.read_bytes().split(b"\n")[1])["key"], payload)
    path.write_bytes(payload)
    folder.chmod(0o777)
    monkeypatch.setattr(compiled.torch.compiler, "load_compiled_function", REAL_LOAD)
    stepper = DiskCompiled(step, "step of Linear", "default")
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        assert torch.equal(stepper(owner, x, 2), owner(x) * 2)
        stepper(owner, torch.randn(3, 4), 2)  # another key: no second warning
    assert not marker.exists() and (stepper.loaded, stepper.compiled) == (0, 2)
    assert len(list(folder.iterdir())) == 1  # nothing saved there
    (record,) = caplog.records
    assert "neither loaded from nor saved to" in record.getMessage() and "writable by other users" in \
        record.getMessage() and "TORCHINDUCTOR_CACHE_DIR" in record.getMessage()


def test_a_foreign_owned_folder_is_refused_with_one_warning(fake_torch, monkeypatch, tmp_path, caplog):
    folder = _cache(monkeypatch, tmp_path)
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)  # a good file, then the folder changes hands
    _as_another_user(monkeypatch, folder)
    stepper = DiskCompiled(step, "step of Linear", "default")
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        assert torch.equal(stepper(owner, x, 2), owner(x) * 2)
        stepper(owner, torch.randn(3, 4), 2)
    assert fake_torch.made == ["compiled"] * 3 and (stepper.loaded, stepper.compiled) == (0, 2)
    assert stepper._plain is None  # compiled ahead of time, in this process
    (record,) = caplog.records
    assert "belongs to another user" in record.getMessage() and str(folder) in record.getMessage()


@pytest.mark.parametrize("change", ["another-owner", "writable", "link"])
def test_a_file_another_user_could_have_written_is_not_read(fake_torch, monkeypatch, tmp_path, caplog, change):
    folder = _cache(monkeypatch, tmp_path)
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)
    path = _one_file(folder)
    if change == "another-owner":
        if os.geteuid() != 0:
            pytest.skip("giving one file to another user takes root")
        os.chown(path, 12345, 12345)
    elif change == "writable":
        path.chmod(0o666)
    else:
        elsewhere = tmp_path / "elsewhere.bin"
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        DiskCompiled(step, "step of Linear", "default")(owner, x, 2)
    assert fake_torch.made == ["compiled", "compiled"]
    (record,) = caplog.records
    assert "is not loaded" in record.getMessage()


def other_step(owner, x, n: int):
    return owner(x) + n


def test_another_steps_file_under_this_steps_name_is_compiled_again_with_one_warning(fake_torch, tmp_path, caplog):
    """A file copied over another's name (the update's file as the verify's) is refused before it is unpickled:
    its header names the key it was saved under. Then it is compiled again and the file put right."""
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)
    DiskCompiled(other_step, "other step", "default")(owner, x, 2)
    mine = next(tmp_path.glob("step-*.bin"))
    mine.write_bytes(next(tmp_path.glob("other_step-*.bin")).read_bytes())
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        out = DiskCompiled(step, "step of Linear", "default")(owner, x, 2)
    assert torch.equal(out, owner(x) * 2) and fake_torch.made == ["compiled"] * 3
    (record,) = caplog.records
    assert "saved for another step or call" in record.getMessage()
    DiskCompiled(step, "step", "default")(owner, x, 2)
    assert fake_torch.made[-1] == "loaded"


def test_guards_that_raise_are_compiled_again_with_one_warning(fake_torch, caplog):
    """Guards written for other arguments raise (``TypeError: too many positional arguments`` from dynamo's
    guard check) rather than fail: the step is compiled again, not crashed."""
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)

    def raising(*args):
        raise TypeError("too many positional arguments")

    fake_torch.loaded_guards = raising
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        out = DiskCompiled(step, "step of Linear", "default")(owner, x, 2)
    assert torch.equal(out, owner(x) * 2) and fake_torch.made == ["compiled", "loaded", "compiled"]
    (record,) = caplog.records
    assert "too many positional arguments" in record.getMessage()


def test_a_damaged_file_is_not_unpickled(fake_torch, tmp_path, caplog):
    owner, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    DiskCompiled(step, "step", "default")(owner, x, 2)
    path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="eagle_mm.decode.compiled"):
        DiskCompiled(step, "step of Linear", "default")(owner, x, 2)
    assert fake_torch.made == ["compiled", "compiled"]  # never handed to torch's loader
    (record,) = caplog.records
    assert "checksum" in record.getMessage()
