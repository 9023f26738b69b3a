"""Nothing half-written: a save interrupted at any write leaves the old head or the new one, never a mix;
malformed head files are refused at load with their path; trees are bounded; unclear inputs get clear errors."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import eagle_mm
from eagle_mm.config import TreeConfig, bound_tree
from eagle_mm.export import export_head, load_exported
from eagle_mm.heads import Eagle3Head, EagleHead
from eagle_mm.heads.io import load_head
from tests.tiny import prompt, tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def _eagle3(target, aux, seed):
    torch.manual_seed(seed)
    head = Eagle3Head.from_target(target, aux_layers=aux, draft_vocab_size=48)
    head.set_draft_vocab(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:48])
    return head


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return (type(a) is type(b) and a.config == b.config and sa.keys() == sb.keys()
            and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa))


# ---- atomic saves: a fault at every write -----------------------------------------------------------
class _Fault(OSError):
    pass


# Every call that writes or renames on the way from a head in memory to a head on disk.
_WRITES = [("eagle_mm.heads.io", "save_file"), ("eagle_mm.heads.engines", "save_file"), ("torch", "save"),
           ("pathlib.Path", "write_text"), ("os", "rename"), ("os", "link"), ("os", "fsync"), ("os", "symlink"),
           ("eagle_mm.heads.atomic", "_exchange")]


def _patch_writes(monkeypatch, fail_at: int | None) -> list:
    """Wrap every write; the ``fail_at``-th call (1-based, over all of them) raises. Returns the call log."""
    calls = []
    for module, name in _WRITES:
        owner = pathlib.Path if module == "pathlib.Path" else __import__(module, fromlist=["_"])
        real = getattr(owner, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            if len(calls) == fail_at:
                raise _Fault(f"injected fault at write {fail_at} ({_name})")
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)
    return calls


def _sweep(tmp_path, monkeypatch, save_old, save_new, load, old, new):
    """Save ``old`` at tmp_path/head, then ``new`` over it with a fault at write k, for every k."""
    root = tmp_path / "head"
    save_old(root)
    # What a training output directory holds beside its head: it must survive every outcome.
    (root / "checkpoints" / "step-00000001").mkdir(parents=True)
    (root / "checkpoints" / "step-00000001" / "optimizer.bin").write_bytes(b"\x01" * 64)
    (root / "train_log.jsonl").write_text('{"step": 1}\n')
    with monkeypatch.context() as m:
        calls = _patch_writes(m, None)
        save_new(root)
        n = len(calls)
    save_old(root)
    assert n >= 4, f"only {n} writes seen: the fault sweep would test nothing"
    outcomes = []
    for k in range(1, n + 1):
        with monkeypatch.context() as m:
            _patch_writes(m, k)
            try:
                save_new(root)
                raised = False
            except _Fault:
                raised = True
        loaded = load(root)
        is_old, is_new = _same(loaded, old), _same(loaded, new)
        assert is_old or is_new, f"fault at write {k}/{n}: the loaded head is neither the old nor the new one"
        outcomes.append("new" if is_new else "old")
        assert (root / "checkpoints" / "step-00000001" / "optimizer.bin").read_bytes() == b"\x01" * 64
        assert (root / "train_log.jsonl").read_text() == '{"step": 1}\n'
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], f"leftovers after write {k}"
        # A failed save leaves the old head, but for the last write: syncing the parent after the swap.
        assert is_new if not raised or k == n else is_old, f"fault at write {k}/{n}"
        if is_new:  # back to the old head for the next fault
            save_old(root)
    assert outcomes.count("old") >= 4, outcomes
    save_new(root)
    assert _same(load(root), new)


@pytest.mark.parametrize("old_format, new_format", [("safetensors", "safetensors"), ("safetensors", "bin"),
                                                    ("bin", "safetensors")])
def test_interrupted_save_leaves_old_or_new_head(tmp_path, monkeypatch, target, old_format, new_format):
    old, new = _eagle3(target, (2, 4, 5), 1), _eagle3(target, (1, 3, 5), 2)
    _sweep(tmp_path, monkeypatch,
           lambda p: old.save_pretrained(p, safe_serialization=old_format == "safetensors"),
           lambda p: new.save_pretrained(p, safe_serialization=new_format == "safetensors"),
           load_head, old, new)


@pytest.mark.parametrize("layouts", [("vllm", "sglang"), ("eagle", "vllm")])
def test_interrupted_export_leaves_old_or_new_head(tmp_path, monkeypatch, target, layouts):
    old, new = _eagle3(target, (2, 4, 5), 3), _eagle3(target, (1, 3, 5), 4)
    _sweep(tmp_path, monkeypatch, lambda p: export_head(old, p, layouts[0]), lambda p: export_head(new, p, layouts[1]),
           load_exported, old, new)


def test_save_follows_a_symlink_and_refuses_a_file(tmp_path, target):
    head = EagleHead.from_target(target)
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    head.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "config.json").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; expected a directory"):
        head.save_pretrained(tmp_path / "file")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    with pytest.raises(ValueError, match="symlink loop"):
        head.save_pretrained(tmp_path / "loop_a")


# ---- bounded trees ------------------------------------------------------------------------------------
def test_tree_depth_and_size_have_documented_maxima():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"depth=1000000 exceeds TreeConfig.MAX_DEPTH=64"):
        TreeConfig.chain(10**6)
    assert time.perf_counter() - t0 < 1.0
    TreeConfig.chain(TreeConfig.MAX_DEPTH)
    with pytest.raises(ValueError, match=r"total_tokens=1024 exceeds TreeConfig.MAX_TOTAL_TOKENS=1023"):
        TreeConfig(depth=8, top_k=16, total_tokens=1024)


def test_bound_tree_clamps_to_what_can_be_committed(caplog):
    chain = TreeConfig.chain(TreeConfig.MAX_DEPTH)
    with caplog.at_level(logging.INFO, logger="eagle_mm.config"):
        assert bound_tree(chain, 4) == TreeConfig.chain(4)
    assert len([r for r in caplog.records if "clamped" in r.getMessage()]) == 1
    wide = TreeConfig(depth=10, top_k=4, total_tokens=100)
    assert bound_tree(wide, 2) == TreeConfig(depth=2, top_k=4, total_tokens=20)
    assert bound_tree(wide, 1) == TreeConfig(depth=1, top_k=4, total_tokens=4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eagle_mm.config"):
        assert bound_tree(wide, 10) is wide
    assert not caplog.records


def test_deep_chain_with_few_new_tokens_returns_fast(target):
    head = EagleHead.from_target(target)
    ids = prompt(8)
    ref = target.generate(ids, max_new_tokens=4, do_sample=False)
    eagle_mm.speculative_generate(target, head, ids, max_new_tokens=4, tree=TreeConfig.chain(2))  # warm up
    t0 = time.perf_counter()
    deep = TreeConfig.chain(TreeConfig.MAX_DEPTH)
    out = eagle_mm.speculative_generate(target, head, ids, max_new_tokens=4, tree=deep, return_dict_in_generate=True)
    assert time.perf_counter() - t0 < 1.0
    assert torch.equal(out.sequences, ref) and out.stats.tree == TreeConfig.chain(4)


# ---- head files validated at load -----------------------------------------------------------------------
def _saved(tmp_path, target, fmt="safetensors"):
    root = tmp_path / "head"
    _eagle3(target, (2, 4, 5), 1).save_pretrained(root, safe_serialization=fmt == "safetensors")
    return root


def _edit(root, **changes):
    """Rewrite tensors of a saved head as another tool would: its config.json then records no checksum."""
    state = load_file(str(root / "model.safetensors"))
    state.update(changes)
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config.pop("eagle_mm_weights_sha256", None)
    (root / "config.json").write_text(json.dumps(config))


def test_float_d2t_is_refused_at_load(tmp_path, target):
    root = _saved(tmp_path, target)
    _edit(root, d2t=load_file(str(root / "model.safetensors"))["d2t"].float())
    with pytest.raises(ValueError, match=rf"{root}: d2t has dtype torch.float32; it holds integer offsets"):
        load_head(root)


def test_d2t_that_disagrees_with_t2d_is_refused(tmp_path, target):
    root = _saved(tmp_path, target)
    _edit(root, d2t=torch.zeros(48, dtype=torch.long))  # draft ids 0..47, but t2d marks a random 48
    with pytest.raises(ValueError, match=rf"{root}: d2t and t2d disagree"):
        load_head(root)
    _edit(root, d2t=torch.full((48,), -1, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        load_head(root)


def test_tensor_dtype_and_shape_checked_against_the_config(tmp_path, target):
    root = _saved(tmp_path, target)
    _edit(root, **{"fc.weight": torch.zeros(64, 3 * 64, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"fc.weight has dtype torch.int32, expected a floating dtype"):
        load_head(root)
    root = _saved(tmp_path, target)
    _edit(root, **{"lm_head.weight": torch.zeros(47, 64)})
    mismatch = r"shape mismatch .* lm_head.weight: checkpoint \(47, 64\) vs head \(48, 64\)"
    with pytest.raises(ValueError, match=rf"{root}: {mismatch}"):
        load_head(root)


@pytest.mark.parametrize("fmt, name", [("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")])
def test_truncated_weights_are_named(tmp_path, target, fmt, name):
    root = _saved(tmp_path, target, fmt)
    data = (root / name).read_bytes()
    (root / name).write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=rf"cannot read {root / name}: .* truncated or corrupt file"):
        load_head(root)


def test_symlink_loops_are_reported_as_loops(tmp_path, target):
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "b", tmp_path / "a")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'a'} is a symlink loop"):
        load_head(tmp_path / "a")
    root = _saved(tmp_path, target)
    (root / "config.json").unlink()
    os.symlink(root / "config.json", root / "config.json")
    with pytest.raises(ValueError, match=rf"{root / 'config.json'} is a symlink loop"):
        load_head(root)


# ---- clear errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [96, -1])
def test_token_ids_outside_the_vocabulary_are_named(target, bad):
    head = EagleHead.from_target(target)
    ids = prompt(6)
    ids[0, 3] = bad
    lo, hi = min(bad, int(ids.min())), max(bad, int(ids.max()))
    with pytest.raises(ValueError, match=rf"token ids in \[{lo}, {hi}\], outside the target's vocabulary \[0, 96\)"):
        eagle_mm.speculative_generate(target, head, ids, max_new_tokens=4)


def test_a_head_on_the_meta_device_is_refused_at_attach(target):
    head = EagleHead.from_target(target).to("meta")
    with pytest.raises(ValueError, match=r"EagleHead has parameters on the meta device \(no data, e.g. fc.weight\)"):
        eagle_mm.speculative_generate(target, head, prompt(6), max_new_tokens=4)
    config = Eagle3Head.from_target(target).config
    with torch.device("meta"):
        empty = Eagle3Head(config)  # building on meta stays allowed
    with pytest.raises(ValueError, match="meta device"):
        empty.attach(target)


def test_a_saved_head_directory_keeps_its_mode(tmp_path, target):
    head = EagleHead.from_target(target)
    head.save_pretrained(tmp_path / "new")
    os.mkdir(tmp_path / "probe")  # what mkdir gives under this umask
    assert (tmp_path / "new").stat().st_mode == (tmp_path / "probe").stat().st_mode
    os.chmod(tmp_path / "new", 0o750)
    head.save_pretrained(tmp_path / "new")
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o750
