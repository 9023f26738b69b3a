"""Where a first default call's seconds go with empty caches (a new machine): one fresh process, empty inductor,
Triton and cost folders, code-tiny greedy at batch 1, 64 new tokens; cProfile of that first call (top functions by
cumulative time), then the second call's wall time. ``--generate-first``: before it, time ``generate``'s first call
(eager, the same prompt and tokens) in the same process: what a fresh machine makes any first call pay (CUDA's and
the attention's kernels loaded from disk), apart from what ours adds.

    PYTHONPATH=. python dev/gpu/cold_profile.py [--sample] [--generate-first]
"""
import os
import sys
import tempfile

_DIR = tempfile.mkdtemp(prefix="eagle_cold_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_DIR, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_DIR, "triton")

import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import eagle_mm  # noqa: E402
from eagle_mm import zoo  # noqa: E402


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = time.perf_counter()
    m = zoo.load("code-tiny", device=dev)
    torch.zeros(1, device=dev).sum().item()
    print(f"load {time.perf_counter() - t:.2f}s", flush=True)
    enc = m.tokenizer([m.prompts[0]], return_tensors="pt").to(dev)
    kw = dict(**enc, max_new_tokens=64, do_sample="--sample" in sys.argv)
    if "--generate-first" in sys.argv:
        t = time.perf_counter()
        m.target.generate(**kw)
        torch.cuda.synchronize() if dev.type == "cuda" else None
        print(f"generate first call {time.perf_counter() - t:.2f}s", flush=True)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    eagle_mm.speculative_generate(m.target, m.eagle3_head, **kw)
    prof.disable()
    print(f"first call {time.perf_counter() - t:.2f}s", flush=True)
    t = time.perf_counter()
    eagle_mm.speculative_generate(m.target, m.eagle3_head, **kw)
    print(f"second call {time.perf_counter() - t:.3f}s", flush=True)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
    print(s.getvalue())


if __name__ == "__main__":
    main()
