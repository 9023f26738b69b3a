"""Where a fresh process's first call goes, and which sampled tree pays on code-tiny (H200, bf16).

    PYTHONPATH=. python dev/gpu/cold_probe.py --out DIR [--parts profile sweep] [sweep options]

profile: fresh processes, each timing two calls and writing a cProfile of the first to DIR: the default greedy call,
then ``compile=True`` with an empty inductor cache (cold), again (warm disk cache), then the same two with dynamo's
precompile cache on (``TORCH_CACHING_PRECOMPILE=1``, saved after the first call). cProfile slows dynamo's tracing
about 2x: read the shares, not the totals. sweep: one process, greedy with the default tree, then sampled (default:
generate()'s temperature 1, top-k 50; ``--temperature``, ``--top-p``) with the default tree and each of ``--trees``
(depth,top_k,total_tokens), 64 new tokens (``--new-tokens``) on "def fibonacci(n):" and three other openings
(``--zoo-prompts``: code-tiny's validation prompts, every row to the end), end-of-sequence off; 8 calls per tree
(seeds 0-7), the first two untimed. Results: ``dev/results/sampled_trees_h200_2026-12-02.json``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import cProfile, io, json, os, pstats, sys, time, torch, eagle_mm
from eagle_mm import zoo
dev = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
m = zoo.load("code-tiny", device=dev)
model, head = m.target, m.eagle3_head
enc = m.tokenizer(["def fibonacci(n):"], return_tensors="pt").to(dev)
model.generation_config.eos_token_id = None
kw = json.loads(sys.argv[1])
times, prof = [], cProfile.Profile()
for i in range(2):
    sync()
    t = time.perf_counter()
    if i == 0: prof.enable()
    out = eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=64, do_sample=False, **kw)
    sync()
    if i == 0: prof.disable()
    times.append(time.perf_counter() - t)
if os.environ.get("TORCH_CACHING_PRECOMPILE") == "1":
    t = time.perf_counter()
    torch.compiler.save_cache_artifacts()
    times.append(time.perf_counter() - t)
s = io.StringIO()
st = pstats.Stats(prof, stream=s)
st.sort_stats("cumulative").print_stats(60)
st.sort_stats("tottime").print_stats(30)
from torch._dynamo.utils import counters
print("RESULT", json.dumps({"times": times, "tokens": out[0].tolist(), "dynamo_cache": dict(counters["dynamo_cache"]),
                            "frames": dict(counters["stats"])}))
print(s.getvalue())
"""


def profile(out: str, only=None) -> None:
    cache = tempfile.mkdtemp()
    runs = [("greedy", {}, {}), ("compiled_cold", {"compile": True}, {}), ("compiled_warm", {"compile": True}, {}),
            ("precompile_cold", {"compile": True}, {"TORCH_CACHING_PRECOMPILE": "1"}),
            ("precompile_warm", {"compile": True}, {"TORCH_CACHING_PRECOMPILE": "1"})]
    for name, kw, env in [r for r in runs if only is None or r[0] in only]:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], capture_output=True, text=True,
                              env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, **env), timeout=150)
        with open(os.path.join(out, f"cprofile_{name}.txt"), "w") as f:
            f.write(proc.stdout + "\n== stderr ==\n" + proc.stderr[-6000:])
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        print(name, f"process {time.perf_counter() - t:.1f}s", line[0][:400] if line else proc.stderr[-800:],
              flush=True)


def sweep(out: str, trees=None, batch: int = 1, warp: dict | None = None, new_tokens: int = 64,
          zoo_prompts: bool = False) -> None:
    import torch

    import eagle_mm
    from eagle_mm import zoo

    m = zoo.load("code-tiny", device="cuda")
    model, head = m.target, m.eagle3_head
    m.tokenizer.padding_side = "left"
    prompts = m.prompts if zoo_prompts else ["def fibonacci(n):", "import os", "class Node:", "def main():"]
    enc = m.tokenizer((prompts * batch)[:batch], return_tensors="pt", padding=True).to("cuda")
    model.generation_config.eos_token_id = None
    trees = trees or [None, (6, 8, 48), (6, 10, 60), (6, 12, 72), (8, 8, 64), (5, 8, 40), (4, 8, 32), (7, 10, 70),
             (6, 16, 64), (5, 6, 30)]
    rows = []
    for sampled in (False, True):
        for t in trees if sampled else [None]:
            tree = None if t is None else eagle_mm.TreeConfig(depth=t[0], top_k=t[1], total_tokens=t[2])
            times, cycles = [], []
            for i in range(8):
                g = torch.Generator("cuda").manual_seed(i) if sampled else None
                torch.cuda.synchronize()
                s = time.perf_counter()
                o = eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=new_tokens, do_sample=sampled,
                                                  min_new_tokens=new_tokens if zoo_prompts else None,
                                                  generator=g, tree=tree, return_dict_in_generate=True,
                                                  **(warp if sampled else {}))
                torch.cuda.synchronize()
                if i >= 2:  # the first two capture
                    times.append(time.perf_counter() - s)
                    cycles.append(o.stats.num_target_forwards)
            times.sort()
            median, mean_cycles = times[len(times) // 2], sum(cycles) / len(cycles)
            row = {"batch": batch, "sampled": sampled, "warp": warp if sampled else None, "tree": t,
                   "median_s": median, "min_s": times[0], "cycles": mean_cycles,
                   "per_cycle_ms": 1e3 * median / mean_cycles}
            rows.append(row)
            print(json.dumps(row), flush=True)
    name = f"sweep_b{batch}{'_warp' if warp else ''}{'_zoo' if zoo_prompts else ''}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", nargs="+", default=["sweep", "profile"])
    p.add_argument("--trees", nargs="*", default=None, help="depth,top_k,total_tokens ...; none: the default")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--zoo-prompts", action="store_true", help="code-tiny's validation prompts, every row to the end")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    trees = None if a.trees is None else [None] + [tuple(map(int, t.split(","))) for t in a.trees]
    for part in a.parts:
        warp = {k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p)) if v is not None}
        profile(a.out) if part == "profile" else sweep(a.out, trees, a.batch, warp or None, a.new_tokens,
                                                                  a.zoo_prompts)
