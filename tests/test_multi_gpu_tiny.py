"""The multi-GPU benchmarks (dev/gpu/multi.sh, split.sh) at tiny size on CPU: every code path they take.

Training: the data step, a 2-process accelerate launch of the worker (gloo; the GPU run uses NCCL), a 1-process
run in this process, and the report. Split targets: CPU + disk-offloaded layers through both placements the GPU
runs use (accelerate.dispatch_model, and from_pretrained with a device_map), greedy speculative == generate.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_multi_gpu, bench_split
from eagle_mm.hf.parts import execution_device, resolve_target
from eagle_mm.hf.features import FeatureCapture

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prep(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi") / "prep"
    assert bench_multi_gpu.main(["data", str(path), "--shape", "tiny", "--max-processes", "2"]) == 0
    return path


def test_training_bench_one_and_two_processes(prep, tmp_path):
    info = json.loads((prep / "prep.json").read_text())
    assert info["rows"] == info["steps"] * info["batch_size"] * 2
    # As dev/gpu/multi.sh launches it (there with NCCL on GPUs; here the processes join over gloo).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(_free_port()), str(REPO / "bench" / "bench_multi_gpu.py"), "worker", str(prep),
           str(tmp_path / "gpu2"), "--result", str(tmp_path / "gpu2.json")]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "gpu2.json").read_text())
    assert two["processes"] == 2 and two["tokens_per_step"] == 2 * info["batch_size"] * info["seq_len"]
    assert {p.name for p in (tmp_path / "gpu2").glob("pid.*")} == {"pid.0", "pid.1"}
    assert bench_multi_gpu.main(["worker", str(prep), str(tmp_path / "gpu1")]) == 0
    one = json.loads((tmp_path / "gpu1" / "result.json").read_text())
    for r in (one, two):
        assert r["timed_steps"] == info["steps"] - 1 - info["warmup"] and r["tokens_per_s"] > 0
        assert len(r["losses"]) == info["steps"] and all(map(torch.isfinite, torch.tensor(r["losses"])))
        assert r["head"]["loads"] and r["head"]["kind"] == "Eagle3Head", r["head"]
        assert r["head"]["draft_vocab_size"] == info["draft_vocab"] and r["head"]["mean_accept_length"] >= 1.0
    results = [tmp_path / "gpu1" / "result.json", tmp_path / "gpu2.json"]
    assert bench_multi_gpu.main(["report", str(tmp_path / "train.json"), *map(str, results)]) == 0
    report = json.loads((tmp_path / "train.json").read_text())
    assert set(report["runs"]) == {"1", "2"} and report["scaling_efficiency_2"] > 0


@pytest.mark.parametrize("via", ["dispatch", "pretrained"])
def test_split_bench_greedy_identity(tmp_path, via):
    out = tmp_path / "split.json"
    status = bench_split.main(["--shape", "tiny", "--devices", "cpu", "disk", "--via", via, "--dtypes", "float32",
                               "--new-tokens", "10", "--prompt-len", "8", "--aux", "1", "3", "4", "--tree", "4", "2",
                               "6", "--work", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads(out.read_text())
    run = report["runs"]["float32"]
    assert status == 0 and report["ok"], run
    assert run["forced"]["identical"] and run["untrained"]["identical"]
    assert run["forced"]["mean_accept_length"] > 1.5
    assert run["placement"]["offloaded_layers"] == [2, 3]  # the second half really sits behind the disk hooks


def test_feature_capture_gathers_on_the_embeddings_execution_device(tmp_path):
    """Offloaded modules keep "meta" weights between forwards: the capture follows the hook, not weight.device."""
    from accelerate import dispatch_model

    model = bench_multi_gpu.build_target("tiny", "cpu", torch.float32)
    dm = bench_split.device_map(4, ["cpu", "disk"], 0.5)
    dm["model.embed_tokens"] = "disk"
    model = dispatch_model(model, device_map=dm, main_device="cpu", offload_dir=str(tmp_path),
                           skip_keys=model._skip_keys_device_placement)
    parts = resolve_target(model)
    assert parts.embed.weight.device.type == "meta" and execution_device(parts.embed) == torch.device("cpu")
    ids = torch.randint(3, 100, (1, 5))
    with FeatureCapture(parts, (1, 3, 4), input_embeds=True) as cap:
        model(input_ids=ids)
        assert cap.features().device == torch.device("cpu")
        assert cap.input_embeds().shape == (1, 5, 64)
