"""bench/bench_vl7b.py at its tiny CPU size: every mode runs, the forcing reaches its level after the image, greedy
tokens equal generate's."""
from __future__ import annotations

import json

from tests.test_bench_8b import _load


def test_bench_vl7b_tiny(tmp_path):
    bench = _load("bench_vl7b")
    out = tmp_path / "tiny.json"
    data = bench.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == data
    assert not [r for r in data["rows"] if "error" in r]
    assert data["meta"]["image_tokens"] == 16 and data["meta"]["prompt_len"] == 34
    rows = [r for r in data["rows"] if "accept" in r]
    assert {(r["mode"], r["accept"]) for r in rows} == {("ours_default", 4.0), ("ours_compiled", 4.0)}
    assert all(r["matches_generate"] for r in rows)
    # The forced head reads its reference by the head's positions; were they the target's M-RoPE positions (which
    # advance by the grid's side over the image, not by its token count), nearly every proposal would be wrong.
    assert all(3.3 < r["mean_accept_length"] <= 4.0 for r in rows)
    assert any(r["mode"] == "generate_compiled" and r["matches_generate"] for r in data["rows"])
    assert len(data["verdict"]) == 1 and "ours_default" in data["verdict"][0] and "ours_compiled" in data["verdict"][0]
