"""Resuming from a checkpoint that cannot be read: named, and handled before the training log is touched."""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil

import pytest

from eagle_mm.train import TrainConfig, train
import eagle_mm.train.checkpoint as checkpoint
from eagle_mm.train.checkpoint import list_checkpoints, resolve_resume
from eagle_mm.cli.train import add_train_parser
from tests.test_train_tools import greedy_rows, one_thread, save_target, write_jsonl  # noqa: F401


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model = save_target(root / "target")
    data = write_jsonl(root / "data.jsonl", greedy_rows(model, 24))
    return {"root": root, "target": str(root / "target"), "data": data}


class _Crash(Exception):
    pass


def _crash_after_4(step, metrics):
    if step == 4:
        raise _Crash


@pytest.fixture(scope="module")
def trained(work):
    """A run of 6 steps stopped after step 4: checkpoints at steps 2 and 4, a log line per step."""
    cfg = TrainConfig(target=work["target"], data=work["data"], output_dir=str(work["root"] / "run"), batch_size=4,
                      mixed_precision="no", save_dtype="float32", max_steps=6, save_every=2, log_every=1)
    with pytest.raises(_Crash):
        train(cfg, on_step=_crash_after_4)
    return cfg


def _copy_run(trained, tmp_path):
    """A private copy of the trained run, with the latest checkpoint's optimizer.bin cut short."""
    out = tmp_path / "run"
    shutil.copytree(trained.output_dir, out)
    latest = list_checkpoints(out)[-1][1]
    optimizer = latest / "optimizer.bin"
    data = optimizer.read_bytes()
    optimizer.write_bytes(data[: len(data) // 2])
    return trained.replace(output_dir=str(out)), latest, optimizer


def _snapshot(out) -> dict:
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, files in os.walk(out) for f in files}


def test_auto_resume_skips_an_unreadable_latest_checkpoint(trained, tmp_path, caplog):
    cfg, latest, optimizer = _copy_run(trained, tmp_path)
    with caplog.at_level(logging.WARNING, logger="eagle_mm.train.checkpoint"):
        result = train(cfg.replace(resume="auto"))
    assert any(str(optimizer) in r.getMessage() and "trying the checkpoint before it" in r.getMessage()
               for r in caplog.records)
    assert result.step == 6 and len(result.losses) == 4  # steps 3 to 6, from the step-2 checkpoint
    log = open(os.path.join(cfg.output_dir, "train_log.jsonl"), encoding="utf-8").read().splitlines()
    steps = [json.loads(line)["step"] for line in log]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in list_checkpoints(cfg.output_dir)] == [4, 6]
    assert len((latest / "optimizer.bin").read_bytes()) > len(optimizer.read_bytes()) // 2  # rewritten whole


def test_an_unreadable_checkpoint_stops_before_anything_is_written(trained, tmp_path, monkeypatch):
    cfg, latest, optimizer = _copy_run(trained, tmp_path)
    before = _snapshot(cfg.output_dir)
    with pytest.raises(ValueError, match=rf"{latest} cannot be resumed: {optimizer} is unreadable"):
        train(cfg.replace(resume=str(latest)))
    earlier = list_checkpoints(cfg.output_dir)[0][1]
    (earlier / "random_states_0.pkl").write_bytes(b"PK\x03\x04 cut")
    both = rf"{optimizer}.*{earlier / 'random_states_0.pkl'}"
    with pytest.raises(ValueError, match=rf"no checkpoint can be resumed: .*{both}"):
        train(cfg.replace(resume="auto"))
    (earlier / "random_states_0.pkl").write_bytes(before[str(earlier / "random_states_0.pkl")])
    assert _snapshot(cfg.output_dir) == before

    # What the file indexes cannot show (a corrupt tensor inside a complete file) fails in the loader: named too.
    from accelerate import Accelerator

    def corrupt(self, input_dir=None, **kw):
        raise RuntimeError("PytorchStreamReader failed reading file data/0: invalid header or archive is corrupted")

    monkeypatch.setattr(Accelerator, "load_state", corrupt)
    with pytest.raises(ValueError, match=rf"cannot resume from checkpoint {earlier}: PytorchStreamReader"):
        train(cfg.replace(resume=str(earlier)))
    after = _snapshot(cfg.output_dir)
    assert after == {**before, **{k: after[k] for k in after if k.endswith("train_config.json")}}


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "head/model.safetensors"])
def test_a_flipped_byte_in_a_checkpoint_is_refused_at_resume(trained, tmp_path, caplog, name):
    """Bytes changed inside a complete file (its index intact) differ from the sha256 recorded at the write:
    ``--resume DIR`` stops naming the file, ``--resume auto`` takes the checkpoint before it."""
    out = tmp_path / "run"
    shutil.copytree(trained.output_dir, out)
    cfg = trained.replace(output_dir=str(out))
    (_, earlier), (_, latest) = list_checkpoints(out)
    state = json.loads((latest / "trainer_state.json").read_text())
    assert sorted(state["sha256"]) == sorted(p.relative_to(latest).as_posix() for p in latest.rglob("*")
                                             if p.is_file() and p.name != "trainer_state.json")
    damaged = latest / name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    before = _snapshot(out)
    with pytest.raises(ValueError, match=rf"checkpoint {latest} cannot be resumed: {damaged} is damaged: its bytes "
                                         rf"changed after it was written .*resume from an earlier checkpoint"):
        train(cfg.replace(resume=str(latest)))
    with caplog.at_level(logging.WARNING, logger="eagle_mm.train.checkpoint"):
        assert resolve_resume(cfg.replace(resume="auto")) == earlier
    assert any(f"{damaged} is damaged" in r.getMessage() for r in caplog.records)
    assert _snapshot(out) == before


def test_output_dir_that_is_a_file_is_refused(work, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="eagle-mm")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    (tmp_path / "out").write_text("not a directory")
    args = parser.parse_args(["train", "--target", work["target"], "--data", work["data"], "--output-dir",
                              str(tmp_path / "out")])
    assert args.func(args) == 2
    assert f"--output-dir '{tmp_path / 'out'}' is an existing file; it must be a directory" in capsys.readouterr().err


def _cli(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="eagle-mm")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train", *args])


def test_invalid_utf8_in_a_row_names_the_file_and_the_row(work, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = open(work["data"], "rb").read().splitlines(keepends=True)
    data.write_bytes(rows[0] + rows[1].replace(b'"', b'"\xff', 1) + b"".join(rows[2:]))
    args = _cli(["--target", work["target"], "--data", str(data), "--output-dir", str(tmp_path / "out")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err == (f"eagle-mm train: error: {data} row 2: not valid UTF-8 (byte b'\\xff' at column 3); save the "
                   f"file as UTF-8\n")


def test_a_full_disk_is_one_line_and_resume_goes_on_exactly(work, trained, tmp_path, monkeypatch, capsys):
    """The disk fills while checkpoint 4 is written: one line (no traceback) saying that the checkpoints so far are
    intact and how to go on; the half-written checkpoint is gone; resuming then logs what an uninterrupted run
    logged (the same losses at steps 3 and 4 as the run of the ``trained`` fixture)."""
    out = tmp_path / "run"
    real = checkpoint.write_state

    def full(path, state):
        if state["step"] == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / checkpoint.STATE_NAME))
        real(path, state)

    monkeypatch.setattr(checkpoint, "write_state", full)
    args = _cli(["--target", work["target"], "--data", work["data"], "--output-dir", str(out), "--batch-size", "4",
                 "--mixed-precision", "no", "--save-dtype", "float32", "--max-steps", "6", "--save-every", "2",
                 "--log-every", "1"])
    assert args.func(args) == 2
    err = capsys.readouterr().err  # the progress bar's lines, then the one line
    latest = out / "checkpoints" / "step-00000002"
    line = (f"eagle-mm train: error: no space left on device while writing {out}/checkpoints/.tmp-step-00000004/"
            f"trainer_state.json; the checkpoints written so far are intact (latest: {latest}), and resuming from one "
            f"continues exactly as if the run had not stopped: free space and run it again with --resume "
            f"(resume='auto')")
    assert "Traceback" not in err and err.endswith("\n" + line + "\n")
    assert [s for s, _ in list_checkpoints(out)] == [2] and not list((out / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(checkpoint, "write_state", real)
    result = train(trained.replace(output_dir=str(out), resume="auto"))
    assert result.step == 6
    log = (out / "train_log.jsonl").read_text().splitlines()
    reference = open(os.path.join(trained.output_dir, "train_log.jsonl")).read().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1, 2, 3, 4, 5, 6]
    assert log[:4] == reference[:4]  # steps 1-2 before the full disk, 3-4 after the resume: bit for bit
