"""The first call in a fresh process: what a notebook or a one-off script feels, against the second call.

Each measurement starts a new Python process that loads the shipped code-tiny (bf16 on CUDA, fp32 on a CPU) and
times, after loading, two calls of one method on "def fibonacci(n):" with exactly 64 new tokens (end-of-sequence
off: greedy would stop after 14, so that "sampled within 2x of greedy" compares equal work): ``generate`` eager, the
default ``speculative_generate`` greedy and sampled, and ``compile=True`` (inductor, maximum speed) greedy. The
compiled method runs twice, in two processes: the second finds inductor's and Triton's disk caches warm.

    PYTHONPATH=. python bench/bench_cold.py --out cold.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


def run(method: str) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD.replace("{call}", METHODS[method])], capture_output=True,
                          text=True, env=dict(os.environ))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        return {"method": method, "error": proc.stderr[:1500] + " ... " + proc.stderr[-1500:]}
    first, second, new = json.loads(line[0][7:])
    row = {"method": method, "first_s": first, "second_s": second, "new_tokens": new,
           "process_s": time.perf_counter() - t}
    dynamo = [ln for ln in proc.stdout.splitlines() if ln.startswith("DYNAMO ")]
    if dynamo and len(json.loads(dynamo[0][7:]).strip().splitlines()) > 2:  # more than the table's header
        row["dynamo_times"] = json.loads(dynamo[0][7:])[:3000]
    if proc.returncode:  # the calls finished; the process failed on its way out
        row["exit_error"] = proc.stderr[:1500]
    return row


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["generate", "ours_greedy", "ours_sampled", "ours_compiled",
                                                    "ours_compiled"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for method in args.methods:
        rows.append(run(method))
        print(json.dumps(rows[-1])[:3000], flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
