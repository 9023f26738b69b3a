"""`eagle-mm train` (the subcommand pair the CLI hooks in) and `accelerate launch -m eagle_mm.train`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import eagle_mm as em
from eagle_mm.train.checkpoint import list_checkpoints
from eagle_mm.cli.train import add_train_parser
from tests.test_train_tools import greedy_rows, one_thread, save_target, write_jsonl  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def _cli(argv):
    parser = argparse.ArgumentParser(prog="eagle-mm")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = save_target(root / "target")
    rows = greedy_rows(model, 24, new=20, chat=True)
    return {"root": root, "model": model, "target": str(root / "target"),
            "data": write_jsonl(root / "chat.jsonl", rows)}


def _common(work, out):
    return ["--target", work["target"], "--data", work["data"], "--output", str(work["root"] / out),
            "--max-steps", "4", "--batch-size", "2", "--mixed-precision", "no", "--save-every", "2",
            "--eval-holdout", "4", "--eval-samples", "2", "--eval-max-new-tokens", "8"]


@pytest.mark.compat
def test_eagle_mm_train_subcommand_trains_a_loadable_head(work):
    status = _cli(["train", *_common(work, "cli-out"), "--kind", "eagle3", "--draft-vocab-size", "40",
                   "--aux-layers", "1", "3", "5"])
    assert status == 0
    out = work["root"] / "cli-out"
    head = em.Eagle3Head.from_pretrained(out, target=work["model"])
    assert head.config.draft_vocab_size == 40 and head.config.aux_layers == (1, 3, 5)
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["max_steps"] == 4 and saved["aux_layers"] == [1, 3, 5]
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["mean_accept_length"] >= 1.0
    # The evaluation drafts a fixed tree for the device (a short chain on a CPU, not TreeConfig()'s GPU tree), so that
    # runs compare: the default call's chooser adapts its tree.
    assert evaluation["tree"] == dataclasses.asdict(em.TreeConfig.reference("cpu")) == dataclasses.asdict(
        em.TreeConfig.chain(3))


def test_cli_reports_bad_data_with_its_row(work, capsys):
    bad = write_jsonl(work["root"] / "bad.jsonl", [{"messages": [{"role": "user", "content": "w1"}]}])
    status = _cli(["train", "--target", work["target"], "--data", bad, "--output", str(work["root"] / "bad")])
    assert status == 2
    assert "row 1: no assistant turn" in capsys.readouterr().err
    assert not (work["root"] / "bad").exists()


def test_cli_names_a_missing_target(work, capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    status = _cli(["train", "--target", str(missing), "--data", work["data"], "--output", str(tmp_path / "out")])
    assert status == 2
    assert f"no such directory: {missing}; pass --target a local model directory" in capsys.readouterr().err


def test_cli_names_a_reference_model_root(work, capsys, tmp_path):
    root = work["root"]  # holds target/: the layout of a zoo model's folder
    status = _cli(["train", "--target", str(root), "--data", work["data"], "--output", str(tmp_path / "out")])
    assert status == 2
    err = capsys.readouterr().err
    assert f"{root} is a reference model's folder, not a model" in err and f"pass --target {root / 'target'}" in err


def test_overwrite_trains_twice_in_a_row_into_one_folder(work, capsys):
    out = work["root"] / "again"
    args = ["train", *_common(work, "again"), "--kind", "eagle3", "--draft-vocab-size", "40", "--eval-holdout", "0",
            "--max-steps", "2"]
    assert _cli(args) == 0 and list_checkpoints(out)
    assert _cli(args) == 2  # the earlier run's checkpoints are refused without --overwrite ...
    assert "already holds checkpoints" in capsys.readouterr().err
    assert _cli([*args, "--overwrite"]) == 0  # ... and cleared with it
    assert [step for step, _ in list_checkpoints(out)] == [2]
    assert em.Eagle3Head.from_pretrained(out, target=work["model"]).config.draft_vocab_size == 40


def test_overwrite_and_resume_exclude_each_other(work, capsys, tmp_path):
    status = _cli(["train", *_common(work, "both"), "--overwrite", "--resume"])
    assert status == 2
    assert "--overwrite starts afresh, --resume auto continues: pass one of them" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_launch_two_processes(work):
    launcher = Path(sys.executable).with_name("accelerate")  # this interpreter's, not another venv's
    launcher = str(launcher) if launcher.exists() else shutil.which("accelerate")
    if launcher is None:
        pytest.skip("accelerate's command line (the `accelerate` script) is not installed")
    out = work["root"] / "ddp"
    # On a machine without GPUs, --multi_gpu starts real processes (the trainer joins them over gloo);
    # accelerate's --cpu flag would start a single process unless mpirun is configured.
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           "-m", "eagle_mm.train", *_common(work, "ddp"), "--kind", "eagle3"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((list_checkpoints(out)[-1][1] / "trainer_state.json").read_text())
    sums = state.pop("sha256")  # every file of the checkpoint, both processes' RNG states included
    assert state == {"step": 4, "num_processes": 2, "format": 1}
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(sums)
    head = em.load_head(out, target=work["model"])
    assert isinstance(head, em.Eagle3Head)


# ---- docs/training.md's two-stage recipe, on the shipped model ------------------------------------------------
def _two_stage_block() -> list[list[str]]:
    """The page's `--dump-features` then `--features` commands, as argv lists (continuation lines joined)."""
    import re
    import shlex

    page = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```", page, re.M | re.S) if "--dump-features" in b)
    commands = [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    assert [c[:3] for c in commands] == [["eagle-mm", "train", "--dump-features"], ["eagle-mm", "train", "--features"]]
    return [c[1:] for c in commands]


def test_two_stage_training_on_the_shipped_tied_model(tmp_path, monkeypatch):
    """code-tiny ties its lm_head to its embedding; training from dumped features loads only those two."""
    from eagle_mm import zoo

    if not zoo.is_available("code-tiny"):
        pytest.skip("the code-tiny reference model is not built (see docs/reference-models.md)")
    target = zoo.model_dir("code-tiny") / "target"
    assert json.loads((target / "config.json").read_text())["tie_word_embeddings"] is True
    monkeypatch.chdir(tmp_path)
    rows = [{"text": f"def f{i}(x):\n    return x + {i}\n" * 3} for i in range(3)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    small = {"--dump-features": ["--max-length", "48", "--target-dtype", "float32"],
             "--features": ["--max-length", "48", "--target-dtype", "float32", "--max-steps", "1", "--batch-size", "1",
                            "--mixed-precision", "no", "--save-dtype", "float32"]}
    for argv in _two_stage_block():
        argv = [str(target) if a == "path/to/target" else a for a in argv]
        assert _cli([*argv, *small[argv[1]]]) == 0, argv
    head = em.load_head(tmp_path / "heads" / "my-head")
    assert isinstance(head, em.Eagle3Head)


# ---- command-line errors and output ------------------------------------------------------------------------
def test_a_two_layer_target_names_the_aux_layers_flag(tmp_path, capsys):
    save_target(tmp_path / "two", num_hidden_layers=2)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "w1 w2 w3 w4 w5 w6"}] * 2)
    common = ["train", "--target", str(tmp_path / "two"), "--data", data, "--max-steps", "1", "--batch-size", "1",
              "--mixed-precision", "no", "--draft-vocab-size", "40"]
    capsys.readouterr()  # save_pretrained's bar
    assert _cli([*common, "--output", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "got 2" in err and "--aux-layers" in err and len(err.strip().splitlines()) == 1, err
    assert _cli([*common, "--output", str(tmp_path / "b"), "--aux-layers", "0", "1", "2"]) == 0
    assert em.Eagle3Head.from_pretrained(tmp_path / "b").config.aux_layers == (0, 1, 2)


def test_a_head_passed_as_the_target_is_named(work, capsys, tmp_path):
    head = tmp_path / "head"
    em.Eagle3Head.from_target(work["model"]).save_pretrained(head)
    assert _cli(["train", "--target", str(head), "--data", work["data"], "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{head} is a draft head, not a target: pass it with --init-head" in err, err


def test_log_lines_do_not_run_onto_the_progress_bar(work, tmp_path):
    """A terminal shows what follows the last carriage return of a line: a log line must start there."""
    import re

    cmd = [sys.executable, "-m", "eagle_mm", "train", *_common(work, "bars"), "--kind", "eagle3", "--log-every", "1",
           "--draft-vocab-size", "40", "--eval-holdout", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [line for line in proc.stderr.split("\n") if " INFO " in line]
    assert any("step 1/4" in line for line in logged), proc.stderr[-3000:]
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO ")
    run_on = [line for line in logged if not stamp.match(line.split("\r")[-1])]
    assert not run_on, run_on[:3]
