"""The first call in a fresh process: what a notebook or a one-off script feels, against the second call.

Each measurement starts a new Python process that loads the shipped code-tiny (bf16 on CUDA, fp32 on a CPU) and
times, after loading, two calls of one method on "def fibonacci(n):" with exactly 64 new tokens (end-of-sequence
off: greedy would stop after 14, so that "sampled within 2x of greedy" compares equal work): ``generate`` eager, the
default ``speculative_generate`` greedy and sampled, and ``compile=True`` (inductor, maximum speed) greedy. Each
speculative method runs in two processes: the first compiles into empty caches (a first use on a machine), the
second finds inductor's and Triton's disk caches warm, with the compiled steps eagle_mm saves in inductor's (a fresh
process on a machine that has run it before).

Every process gets the same cache folders, empty at the start (``--cache-dir``, default a new temporary folder):
inductor's (``TORCHINDUCTOR_CACHE_DIR``) and Triton's (``TRITON_CACHE_DIR``), so "cold" is cold and a second
process finds only what the first wrote. Python's own bytecode cache is what a pip install writes once:
where the interpreter has none for torch's modules and may not write it (the lent GPU's venv), the benchmark
compiles it first into ``<cache-dir>/pyc`` (``PYTHONPYCACHEPREFIX``), else every process compiles the modules it
imports from source (616 of them and 3.2 s of a second ``compile=True`` process's first call, which imports
inductor, in a cProfile on the H200), which no installed copy does.

    PYTHONPATH=. python bench/bench_cold.py --out cold.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

METHODS = {
    "generate": "model.generate(**enc, max_new_tokens=64, do_sample=False)",
    "ours_greedy": "eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=64, do_sample=False)",
    "ours_sampled": "eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=64, do_sample=True, "
                    "generator=torch.Generator(model.device).manual_seed(0))",
    "ours_compiled": "eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=64, do_sample=False, "
                     "compile=True)",
}

CHILD = """
import time, json, torch, eagle_mm
from eagle_mm import zoo
dev = "cuda" if torch.cuda.is_available() else "cpu"
m = zoo.load("code-tiny", device=dev)
model, head = m.target, m.eagle3_head
enc = m.tokenizer(["def fibonacci(n):"], return_tensors="pt").to(dev)
model.generation_config.eos_token_id = None
times = []
for _ in range(2):
    if dev == "cuda": torch.cuda.synchronize()
    t = time.perf_counter()
    out = {call}
    if dev == "cuda": torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
print("RESULT", json.dumps(times + [out.shape[1] - enc.input_ids.shape[1]]))
print("DYNAMO", json.dumps(torch._dynamo.utils.compile_times(repr="str")))  # where a compiled call's time went
"""


def cache_env(root: str) -> dict:
    """The children's environment: inductor's and Triton's caches under ``root``, and Python's bytecode where an
    install would have it (see the module docstring)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
               TRITON_CACHE_DIR=os.path.join(root, "triton"))
    probe = os.path.join(sysconfig.get_paths()["purelib"], "torch", "_inductor", "compile_fx.py")
    if os.path.exists(probe) and not os.path.exists(importlib.util.cache_from_source(probe)):
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(root, "pyc")
        site = os.path.dirname(os.path.dirname(os.path.dirname(probe)))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0",
                        *(os.path.join(site, p) for p in ("torch", "triton", "transformers"))],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"no bytecode cache for torch's modules: compiled into {env['PYTHONPYCACHEPREFIX']} first "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    return env


def run(method: str, env: dict) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD.replace("{call}", METHODS[method])], capture_output=True,
                          text=True, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        return {"method": method, "error": proc.stderr[:1500] + " ... " + proc.stderr[-1500:]}
    first, second, new = json.loads(line[0][7:])
    row = {"method": method, "first_s": first, "second_s": second, "new_tokens": new,
           "process_s": time.perf_counter() - t}
    dynamo = [ln for ln in proc.stdout.splitlines() if ln.startswith("DYNAMO ")]
    if dynamo and len(json.loads(dynamo[0][7:]).strip().splitlines()) > 2:  # more than the table's header
        row["dynamo_times"] = json.loads(dynamo[0][7:])[:3000]
    logged = [ln for ln in proc.stderr.splitlines() if "compil" in ln.lower()]  # e.g. a step compiled in-process only
    if logged:
        row["log"] = logged[:20]
    if proc.returncode:  # the calls finished; the process failed on its way out
        row["exit_error"] = proc.stderr[:1500]
    return row


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Each speculative method twice: its first process compiles our Triton kernels (and compile=True inductor's)
    # into the empty caches, as a first use on a machine does; the second is a fresh process on a used machine.
    p.add_argument("--methods", nargs="+", default=["generate", "ours_greedy", "ours_greedy", "ours_sampled",
                                                    "ours_sampled", "ours_compiled", "ours_compiled"])
    p.add_argument("--out", default=None)
    p.add_argument("--cache-dir", default=None, help="the caches' folder, empty at the start (default: a new one)")
    args = p.parse_args(argv)
    root = args.cache_dir or tempfile.mkdtemp(prefix="bench_cold_")
    if os.path.isdir(root) and any(os.scandir(root)):
        raise ValueError(f"--cache-dir {root!r} is not empty: the first process of each method must start cold")
    env = cache_env(root)
    rows = []
    for method in args.methods:
        rows.append(run(method, env))
        print(json.dumps(rows[-1])[:3000], flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
