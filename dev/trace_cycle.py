"""Which eagle_mm modules and functions one decode cycle touches: ``sys.setprofile`` over a default greedy call.

The call: a tiny random llama-shaped target and a fresh EAGLE-3 head on the CPU, ``speculative_generate`` with its
defaults (the chooser picks the tree, or no tree, from what it measures here) or the tree ``--tree`` gives, and 12
new tokens, once to warm up and once traced. "One cycle" is the window from one call of the marker
function (``--marker``, default ``_cycle`` in ``eagle_mm.decode.loop``) to the next, taken at its third call (the
first cycles pay once-per-call work, as the chooser's first reading of its costs): one pass of the decode loop,
whatever it calls. Counts every eagle_mm function entered (comprehensions included, as
the interpreter reports them), and the switches between modules in call order.

    python dev/trace_cycle.py [--marker NAME] [--tree DEPTH,TOP_K,TOTAL] [--list]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trace(marker: str, tree=None) -> list[tuple[str, str]]:
    import eagle_mm as em
    from tests.tiny import prompt, tiny_model

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    ids = prompt(10)
    em.speculative_generate(model, head, ids, max_new_tokens=12, tree=tree)  # warm: first-call work is not a cycle's
    calls: list[tuple[str, str]] = []
    seen = {"marks": 0}

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "?")
        code = frame.f_code
        if code.co_name == marker and module.startswith("eagle_mm.decode"):
            seen["marks"] += 1
        if seen["marks"] == 3 and module.startswith("eagle_mm"):
            calls.append((module, getattr(code, "co_qualname", code.co_name)))

    sys.setprofile(profile)
    try:
        em.speculative_generate(model, head, ids, max_new_tokens=12, tree=tree)
    finally:
        sys.setprofile(None)
    if seen["marks"] < 4:
        raise SystemExit(f"the marker {marker!r} ran {seen['marks']} times; the call needs at least 4 cycles")
    return calls


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--marker", default="_cycle", help="the function whose calls delimit a cycle")
    p.add_argument("--tree", help="DEPTH,TOP_K,TOTAL: decode with this TreeConfig (default: the chooser's)")
    p.add_argument("--list", action="store_true", help="also list the call path, in call order")
    args = p.parse_args(argv)
    tree = None
    if args.tree:
        import eagle_mm as em

        tree = em.TreeConfig(*(int(x) for x in args.tree.split(",")))
    calls = trace(args.marker, tree)
    by_module = collections.OrderedDict()
    for module, fn in calls:
        by_module.setdefault(module, []).append(fn)
    switches = sum(a[0] != b[0] for a, b in zip(calls, calls[1:]))
    print(f"modules {len(by_module)}, functions {len(set(calls))}, calls {len(calls)}, switches {switches}")
    for module, fns in by_module.items():
        print(f"  {module}: {', '.join(dict.fromkeys(fns))}")
    if args.list:
        last = None
        for module, fn in calls:
            if (module, fn) != last:
                print(f"    {module}.{fn}")
            last = (module, fn)


if __name__ == "__main__":
    main()
