"""How well the chooser's acceptance model predicts trees it has not seen: fit on one tree's per-position counts
(dev/probes/acceptance_by_tree.py's output), predict every tree's mean accepted length, report the errors. The
model of ``eagle_mm.decode.acceptance`` against its earlier two-number form (c = a), given as a file.

    PYTHONPATH=. python dev/probes/acceptance_fit.py greedy.jsonl --fit-on 3/8/48 [--old old_acceptance.py]
"""
import argparse
import importlib.util
import json
import sys

from eagle_mm.config import TreeConfig
from eagle_mm.decode import acceptance as new


def tree_of(t):
    d, k, n = t
    return TreeConfig.chain(d) if k == 1 else TreeConfig(d, k, n)


def predict(mod, rows, fit_on):
    est = mod.Acceptance()
    for r in rows:
        if r["tree"] in fit_on:
            est.observe(tree_of(r["tree"]), r["drafts"], r["counts"])
    fitted = est.fit()
    got = est.expected_lengths([tree_of(r["tree"]) for r in rows])
    return fitted, {tuple(r["tree"]): got[tree_of(r["tree"])] for r in rows}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--fit-on", nargs="+", required=True)
    p.add_argument("--old", default=None)
    a = p.parse_args()
    rows = [json.loads(x) for x in open(a.data)]
    fit_on = [[int(v) for v in f.split("/")] for f in a.fit_on]
    models = {"new": new}
    if a.old:
        spec = importlib.util.spec_from_file_location("old_acceptance", a.old)
        old = sys.modules["old_acceptance"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        models["old"] = old
    preds = {}
    for name, mod in models.items():
        fitted, preds[name] = predict(mod, rows, fit_on)
        print(name, "fit", tuple(round(x, 3) for x in fitted))
    print(f"{'tree':>8} {'measured':>8} " + " ".join(f"{n:>8}" for n in preds))
    err = {n: [] for n in preds}
    for r in rows:
        t = tuple(r["tree"])
        line = f"{'/'.join(map(str, t)):>8} {r['mean_accept']:8.2f} "
        for n in preds:
            line += f"{preds[n][t]:8.2f} "
            err[n].append(abs(preds[n][t] - r["mean_accept"]) / r["mean_accept"])
        print(line)
    for n, e in err.items():
        print(n, "mean abs rel error", round(sum(e) / len(e), 3), "max", round(max(e), 3))


if __name__ == "__main__":
    main()
