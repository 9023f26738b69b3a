"""Per call, and per cycle of each call, what the default call (or a given tree) does as calls repeat at a batch:
tokens per forward, the chooser's decisions, and for each cycle the rows' mean committed tokens and the depth
drafted. Written to tell, on a GPU, whether a first call's acceptance differs (CUDA-graph captures, the chooser's
probe, a new storage size) from the chooser switching trees; on a CPU with the GPU path's bookkeeping
(``graphs_on_cpu.py``) the acceptance was the same and the chooser switched (issue 36, 2026-12-06).

    python dev/probes/first_call_accept.py --batches 1 4 4 4 --tree 5,8,64   (--tree none: the default call)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[4, 4, 4])
    p.add_argument("--tree", default="5,8,64")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--no-overlap", action="store_true", help="the next draft waits for the host read")
    a = p.parse_args()
    import eagle_mm
    from eagle_mm import zoo
    from eagle_mm.decode import loop

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = zoo.load("code-tiny", device=dev)
    tok = m.tokenizer
    tok.padding_side = "left"
    tree = None if a.tree == "none" else eagle_mm.TreeConfig(*map(int, a.tree.split(",")))
    if a.no_overlap:
        eagle_mm.decoder(m.target, m.eagle3_head, dev).overlaps = False
    lengths = []
    commit = loop._commit

    def spy(call, state, new_tokens, kept=None):  # per cycle: the rows' mean committed tokens, the tree's depth
        lengths.append(f"{sum(map(len, new_tokens)) / len(new_tokens):.1f}/{call.dec.tree.depth}")
        return commit(call, state, new_tokens, kept)
    loop._commit = spy
    for b in a.batches:
        enc = dict(tok((m.prompts * b)[:b], return_tensors="pt", padding=True).to(dev))
        lengths.clear()
        out = eagle_mm.speculative_generate(m.target, m.eagle3_head, **enc, max_new_tokens=a.new,
                                            min_new_tokens=a.new, do_sample=False, tree=tree,
                                            return_dict_in_generate=True)
        s = out.stats
        whys = [c.why + ':' + str(c.tree.depth) for c in s.choices]
        print(f"batch {b}: accept {s.mean_accept_length:.2f} setup {s.time_compile:.2f}s tree {s.tree} {whys} "
              f"cycles (mean/depth) {' '.join(lengths[1:48])}", flush=True)


if __name__ == "__main__":
    main()
