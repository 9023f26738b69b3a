"""bench/bench_8b.py at its tiny CPU size: every mode runs, results land in the JSON, greedy tokens match."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.tiny import tiny_model

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_8b_tiny(tmp_path):
    """Every mode (the static path uncompiled here, which keeps this fast)."""
    bench = _load("bench_8b")
    out = tmp_path / "tiny.json"
    data = bench.main(["--tiny", "--accept", "1", "3", "--new-tokens", "12", "--out", str(out),
                       "--cpu-compile-mode", "none"])
    assert json.loads(out.read_text()) == data
    assert not [r for r in data["rows"] if "error" in r]
    rows = [r for r in data["rows"] if "accept" in r]
    assert {(r["mode"], r["accept"]) for r in rows} == {(m, a) for m in ("ours_default", "ours_compiled", "ours_eager")
                                                        for a in (1.0, 3.0)}
    assert all(r["matches_generate"] for r in rows)
    forced3 = [r["mean_accept_length"] for r in rows if r["accept"] == 3.0]
    assert all(2.5 < a <= 3.0 for a in forced3)  # the forcing reaches the asked acceptance
    for r in rows:  # the host time per cycle, by phase, adds up to the whole
        assert r["draft_ms"] > 0 and r["verify_ms"] > 0 and r["cudagraph_skips"] == 0
        assert abs(r["draft_ms"] + r["verify_ms"] + r["other_ms"] - r["cycle_ms"]) < 1e-6
    assert any(r["mode"] == "generate_compiled" and r["matches_generate"] for r in data["rows"])


@pytest.mark.slow
def test_bench_8b_tiny_compiled(tmp_path):
    """ours_compiled through inductor on the CPU (the --tiny default): generate's tokens; --profile's tables."""
    bench = _load("bench_8b")
    out = tmp_path / "tiny.json"
    data = bench.main(["--tiny", "--modes", "ours_compiled", "--accept", "3", "--new-tokens", "12", "--profile",
                       "--out", str(out)])
    rows = [r for r in data["rows"] if r["mode"] == "ours_compiled"]
    assert rows and not [r for r in rows if "error" in r]
    timed = [r for r in rows if "accept" in r]
    assert timed and all(r["matches_generate"] and r["compiled"] == "default" for r in timed)
    text = (tmp_path / "tiny_profile_ours_compiled.txt").read_text()
    assert "== top 40 by CPU time ==" in text and "aten::" in text


def test_wrong_positions_mean_gap():
    forced = _load("forced")
    for tau in (1, 2, 2.5, 4):
        w = forced.wrong_positions(400, tau)
        gaps = torch.diff(w.nonzero().flatten()).float()
        assert abs(gaps.mean().item() - tau) < 0.05


def test_forced_head_reduced_draft_vocab():
    """Reference tokens outside the draft vocabulary are counted as wrong, never proposed out of range."""
    import eagle_mm as em

    forced = _load("forced")
    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model, draft_vocab_size=48)
    ref = torch.tensor([[5, 60, 7, 8, 9, 10]])
    index = torch.full((96,), -1)
    index[:48] = torch.arange(48)
    fh = forced.ForcedHead(head, ref, draft_index=index)
    pos = torch.arange(4)[None]
    embeds = head.embed(torch.zeros(1, 4, dtype=torch.long))
    mask = torch.zeros(1, 1, 4, 4)
    _, logits, _ = fh.step(embeds, torch.zeros(1, 4, head.config.hidden_size), pos, mask, None)
    assert logits.shape[-1] == 48
    assert logits.argmax(-1).tolist() == [[7, 8, 9, 10]]
    fh2 = forced.ForcedHead(head, torch.tensor([[5, 6, 60, 8, 9, 10]]), draft_index=index)
    _, logits, _ = fh2.step(embeds, torch.zeros(1, 4, head.config.hidden_size), pos, mask, None)
    assert logits.argmax(-1).tolist() == [[1, 8, 9, 10]]  # 60 has no draft id: proposed wrong (0 + 1)
