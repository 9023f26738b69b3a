"""What a forced tree's calls take against what the chooser's cost table predicts for it, row by row.

For each row (greedy/sampled x batch) the default call runs first (it probes the costs and learns the host's share),
then each tree of ``--trees`` is forced (one untimed call: captures; then ``--calls`` timed), and HF static. Per
tree: tokens/s, cycles, seconds per cycle, the steps' predicted seconds per cycle at the full batch and at one row
(``costs.cycle_seconds``), and the chooser's learned host share. One JSON line per measurement.

    PYTHONPATH=. python dev/gpu/tree_costs.py --rows greedy1 greedy16 --out costs.json
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

import eagle_mm
from eagle_mm import zoo
from eagle_mm.config import TreeConfig
from eagle_mm.decode.costs import cycle_seconds

from chooser_calls import row_inputs  # dev/gpu, this script's folder

TREES = ["none", "2/1/2", "3/1/3", "4/2/6", "4/4/16", "3/8/48", "5/8/64", "6/8/48"]


def tree_of(name: str) -> TreeConfig:
    if name == "none":
        return TreeConfig.none()
    d, k, n = (int(x) for x in name.split("/"))
    return TreeConfig.chain(d) if k == 1 else TreeConfig(d, k, n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", nargs="+", default=["greedy1", "greedy4", "greedy16", "greedy32", "sampled16"])
    p.add_argument("--trees", nargs="+", default=TREES)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in ("eagle_mm.decode.chooser", "eagle_mm.decode.session"):  # the probes' seconds, the choices
        logging.getLogger(name).setLevel(logging.INFO)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    m = zoo.load("code-tiny", device=dev)
    model, head = m.target, m.eagle3_head
    out = []

    def emit(rec):
        out.append(rec)
        print(json.dumps(rec), flush=True)

    for row in args.rows:
        mode, batch, kw = row_inputs(m, row, dev, args.new_tokens)
        dec = eagle_mm.decoder(model, head)

        def timed(**extra):
            sync()
            t = time.perf_counter()
            o = eagle_mm.speculative_generate(model, head, **kw, **extra, return_dict_in_generate=True)
            sync()
            return time.perf_counter() - t, o.stats

        for name in ["default"] + args.trees:
            extra = {} if name == "default" else {"tree": tree_of(name)}
            timed(**extra)  # untimed: probes, captures
            got = [timed(**extra) for _ in range(args.calls)]
            wall = statistics.median(w for w, _ in got)
            s = got[-1][1]
            rec = {"row": row, "tree": name, "tok_s": batch * args.new_tokens / wall, "wall_s": wall,
                   "cycles": s.num_target_forwards, "accept": s.mean_accept_length,
                   "ms_per_cycle": 1e3 * (s.time_draft + s.time_verify + s.time_other) / max(s.num_target_forwards, 1),
                   "draft_ms": 1e3 * s.time_draft, "verify_ms": 1e3 * s.time_verify, "other_ms": 1e3 * s.time_other,
                   "prefill_ms": 1e3 * s.time_prefill, "setup_s": [round(x.time_compile, 4) for _, x in got]}
            if name == "default":
                rec["path"] = [f"{c.tree.depth}/{c.tree.top_k}/{c.tree.total_tokens}@{c.batch}" for c in s.choices]
            ch = dec.chooser
            if mode == "greedy" and ch is not None:
                kind = "greedy"
                table = ch.table(kind)
                if table and name != "default":
                    t = tree_of(name)
                    rec["pred_ms_full"] = 1e3 * cycle_seconds(table, batch, t)
                    rec["pred_ms_one"] = 1e3 * cycle_seconds(table, 1, t)
                rec["overhead_ms"] = {f"{b}/{d}": round(1e3 * v, 3) for (k, b, d), v in ch.overhead.items()
                                      if k == kind}
            emit(rec)
        model.generate(**kw, cache_implementation="static")  # untimed: compiles
        sync()
        t = time.perf_counter()
        for _ in range(2):
            model.generate(**kw, cache_implementation="static")
        sync()
        emit({"row": row, "tree": "hf_static", "tok_s": batch * args.new_tokens * 2 / (time.perf_counter() - t)})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
