"""The CUDA-graph path's bookkeeping on a CPU: the default call's "graphs" mode (whole-cache steps, bucketed
prefill, the next draft launched before the host read), each step's first run of a signature followed by its undo
and a second run, as ``graphs.OwnGraph`` warms up, restores and captures. Prints per call the tokens per forward and
per cycle the rows' mean committed tokens and the depth drafted, with and without the emulation.

    python dev/probes/graphs_on_cpu.py --batches 1 4 4 --tree 5,8,64
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def emulate(twice: bool) -> None:
    from eagle_mm.decode import graphs, loop, storage
    from eagle_mm.decode.signature import Signature

    choose = loop.choose_mode
    loop.choose_mode = lambda ci, comp, model=None, **kw: "graphs" if comp is None and ci is None else choose(
        ci, comp, model, **kw)
    storage.Storage.wait = lambda self: None

    def call(self, *args, undo=None):
        key = Signature(args, self.unkeyed).key
        seen = self.__dict__.setdefault("_seen_cpu", set())
        undo = undo if undo is not None else self.undo
        if twice and key not in seen and undo is not None:
            seen.add(key)
            restore = undo()
            self.inner(*args)
            restore()
        return self.inner(*args)
    graphs.OwnGraph.__call__ = call


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 4])
    p.add_argument("--tree", default="5,8,64")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--once", action="store_true", help="graphs mode without the warm-up run and undo")
    p.add_argument("--no-overlap", action="store_true")
    a = p.parse_args()
    emulate(not a.once)
    import eagle_mm
    from eagle_mm import zoo
    from eagle_mm.decode import loop

    m = zoo.load("code-tiny", device=torch.device("cpu"))
    tok = m.tokenizer
    tok.padding_side = "left"
    eagle_mm.decoder(m.target, m.eagle3_head, "cpu").overlaps = not a.no_overlap
    tree = None if a.tree == "none" else eagle_mm.TreeConfig(*map(int, a.tree.split(",")))
    cycles = []
    commit = loop._commit

    def spy(call, state, new_tokens, kept=None):
        cycles.append(f"{sum(map(len, new_tokens)) / len(new_tokens):.1f}/{call.dec.tree.depth}")
        return commit(call, state, new_tokens, kept)
    loop._commit = spy
    for b in a.batches:
        enc = dict(tok((m.prompts * b)[:b], return_tensors="pt", padding=True))
        cycles.clear()
        out = eagle_mm.speculative_generate(m.target, m.eagle3_head, **enc, max_new_tokens=a.new,
                                            min_new_tokens=a.new, do_sample=False, tree=tree,
                                            return_dict_in_generate=True)
        ref = m.target.generate(**enc, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
        s = out.stats
        for c in s.choices:
            print("   ", c)
        print(f"batch {b}: accept {s.mean_accept_length:.2f} mode {s.mode} identical {torch.equal(ref, out.sequences)} "
              f"cycles {' '.join(cycles[1:30])}", flush=True)


if __name__ == "__main__":
    main()
