"""The chooser's host time in default calls: code-tiny on this machine's CPU, 8 calls of 128 tokens at batch 1, the
seconds spent inside ``Session.start``, ``next_tree`` and ``finish`` against the whole call.

    python dev/probes/chooser_share.py [greedy|sampled]
"""
from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import eagle_mm  # noqa: E402
from eagle_mm import zoo  # noqa: E402
from eagle_mm.decode import session as S  # noqa: E402

spent: dict = {}


def _timed(name, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
    return run


def main(mode: str = "greedy") -> None:
    S.Session.start = classmethod(_timed("start", S.Session.start.__func__))
    S.Session.next_tree = _timed("next_tree", S.Session.next_tree)
    S.Session.finish = _timed("finish", S.Session.finish)
    m = zoo.load("code-tiny", device=torch.device("cpu"))
    m.tokenizer.padding_side = "left"
    enc = dict(m.tokenizer(m.prompts[:1], return_tensors="pt", padding=True))
    kw = dict(do_sample=True, temperature=0.8, top_p=0.95) if mode == "sampled" else dict(do_sample=False)
    for i in range(8):
        spent.clear()
        t = time.perf_counter()
        out = eagle_mm.speculative_generate(m.target, m.eagle3_head, **enc, max_new_tokens=128, min_new_tokens=128,
                                            generator=torch.Generator().manual_seed(i),
                                            return_dict_in_generate=True, **kw)
        s = time.perf_counter() - t
        total = sum(spent.values())
        print(f"call {i}: {s * 1e3:.1f} ms, {out.stats.num_target_forwards} forwards, chooser {total * 1e3:.2f} ms "
              f"({100 * total / s:.1f}%): " + " ".join(f"{k} {v * 1e3:.2f}" for k, v in spent.items()))


if __name__ == "__main__":
    main(*sys.argv[1:2])
