"""8B-scale speculative decoding with forced acceptance: tokens/s of generate and ours, eager and compiled.

Target: a random-init Llama-3.1-8B-shaped model in bf16 (bench/shapes.py), its embeddings and lm_head arranged
by ``shapes.make_peaked`` so that greedy decoding has wide margins (no bf16 near-ties); head: an EAGLE-3 head of the
official 8B shape (one 4096-wide layer, a 32k draft vocabulary). Random weights give no real acceptance, so
``forced.ForcedHead`` replaces the head's proposals (after its real computation) by the target's own greedy
continuation, made wrong at positions chosen for a mean of ``--accept`` tokens per cycle. Modes, in run order:
  ceiling            plain decoding's bandwidth bound: measured copy bandwidth / the target's weight bytes
  generate_eager     model.generate(do_sample=False), dynamic cache
  ours_default       speculative_generate(...), the default call: the engine, its eager steps as CUDA graphs
  ours_compiled      speculative_generate(compile=True): the verify and update compiled by inductor, all captured
  generate_compiled  model.generate(cache_implementation="static"): HF compiles the decode step on CUDA
  ours_eager         speculative_generate(cache_implementation="dynamic"): the engine's steps eagerly (last: the slowest)
Each of our modes first decodes with every proposal wrong (which also compiles, for ours_compiled); that
output is the forcing reference of the mode, so bf16 near-ties between kernels cannot derail the forcing.
Greedy rows report whether the tokens equal generate's (and the first differing position), and the loop's host
timings per cycle (``SpeculativeStats``): ``draft_ms`` (launching the draft steps), ``verify_ms`` (launching the
verify, the processors and the acceptance), ``other_ms`` (the cache/head update, the wait for the GPU at the cycle's
one host read, committing tokens and stopping checks); the prefill apart (``prefill_ms``). ``cudagraph_skips``: graphs inductor ran
without CUDA graphs during the row (should be 0). ``--profile`` runs one more decode of each of our modes at
the first --accept level under torch.profiler and writes its top-40 ops (by self CUDA time, by CPU time) next
to --out. Results are written to --out after every measurement, so a timeout still leaves what was measured.

    PYTHONPATH=. python bench/bench_8b.py --out 8b.json --profile   # the H200 run
    PYTHONPATH=. python bench/bench_8b.py --tiny --out tiny.json    # a tiny model on CPU (inductor), seconds
    PYTHONPATH=. python bench/bench_8b.py --qwen05b --modes generate_eager ours_default --accept 3 --chain
                                                                    # the memory-bound CPU case
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forced import ForcedHead, min_depth  # noqa: E402
from harness import timed_call  # noqa: E402

MODES = ("ceiling", "generate_eager", "ours_default", "ours_compiled", "generate_compiled", "ours_eager")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on CPU (fp32) instead of the 8B shape")
    p.add_argument("--qwen05b", action="store_true",
                   help="a Qwen2.5-0.5B-shaped target on CPU (fp32): the memory-bound CPU case")
    p.add_argument("--accept", type=float, nargs="+", default=[1, 2, 3, 4, 5], help="forced mean tokens per cycle")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=32, help="tree nodes verified per cycle (root excluded)")
    p.add_argument("--chain", action="store_true", help="draft a chain of --depth tokens instead of a tree")
    p.add_argument("--layers", type=int, default=32, help="target layers (fewer for smoke runs)")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile mode of ours_compiled on CUDA")
    p.add_argument("--cpu-compile-mode", default="default",
                   help="torch.compile mode of ours_compiled on CPU (--tiny); 'none': the static path uncompiled")
    p.add_argument("--profile", action="store_true",
                   help="profile one decode per mode of ours at the first --accept level (a text file beside --out)")
    p.add_argument("--out", default=None, help="JSON results, rewritten after every measurement")
    return p.parse_args(argv)


class Results:
    def __init__(self, path: str | None, meta: dict):
        self.path, self.data = path, {"meta": meta, "rows": []}
        self.save()

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        self.save()

    def save(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def build(args, device):
    """(target, EAGLE-3 head) on ``device``."""
    import eagle_mm

    if args.qwen05b:
        from shapes import random_qwen05b_target

        target = random_qwen05b_target()
    elif args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                          tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        target = LlamaForCausalLM(cfg).to(device).eval().requires_grad_(False)
    else:
        from shapes import random_8b_target

        target = random_8b_target(args.layers)
    from shapes import make_peaked

    make_peaked(target)  # greedy far from ties: bf16 rounding cannot derail the forcing
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    vocab = target.config.vocab_size
    with torch.device(device):
        head = eagle_mm.Eagle3Head.from_target(target, draft_vocab_size=min(args.draft_vocab, vocab // 2))
    return target, head.eval().requires_grad_(False)


def fit_draft_vocab(head, reference: torch.Tensor) -> torch.Tensor:
    """Make the draft vocabulary hold every reference token (filled up with the lowest other ids); returns the
    (V,) draft id of each target id, -1 outside."""
    vd, V = head.config.draft_vocab_size, head.config.vocab_size
    used = torch.zeros(V, dtype=torch.bool)
    used[reference.flatten().cpu()] = True
    ids = torch.cat((used.nonzero().flatten(), (~used).nonzero().flatten()))[:vd].sort().values
    head.set_draft_vocab(ids)
    index = torch.full((V,), -1, dtype=torch.long)
    index[ids] = torch.arange(vd)
    return index.to(head.d2t.device)


def first_diff(a: torch.Tensor, b: torch.Tensor, start: int):
    """First generated index where a and b differ, None if equal."""
    n = min(a.shape[1], b.shape[1])
    neq = (a[:, :n].cpu() != b[:, :n].cpu()).any(0).nonzero().flatten()
    if neq.numel():
        return int(neq[0]) - start
    return None if a.shape[1] == b.shape[1] else n - start


def compile_mode(args, device):
    """ours_compiled's torch.compile mode here, or False (the static path uncompiled)."""
    if device.type == "cuda":
        return args.compile_mode
    return False if args.cpu_compile_mode == "none" else args.cpu_compile_mode


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def per_cycle(stats) -> dict:
    """The loop's host time per cycle, by phase, in ms (the prefill, before the first cycle, apart)."""
    n = max(stats.num_target_forwards, 1)
    loop = stats.time_draft + stats.time_verify + stats.time_other
    return {"draft_ms": 1e3 * stats.time_draft / n, "verify_ms": 1e3 * stats.time_verify / n,
            "other_ms": 1e3 * stats.time_other / n, "cycle_ms": 1e3 * loop / n, "prefill_ms": 1e3 * stats.time_prefill}


def device_per_cycle(stats) -> dict:
    """A profiled call's (``profile=True``) device time per cycle by phase, in ms, and the host's: the cycles' wall
    time less the phases' spans."""
    n = max(stats.num_target_forwards, 1)
    phases = {f"device_{k}_ms": 1e3 * v / n for k, v in stats.device_time.items()}
    cycles = stats.time_draft + stats.time_verify + stats.time_other
    return {**phases, "device_host_ms": 1e3 * (cycles - sum(stats.device_time.values())) / n}


def profile_decode(decode, device, path: str) -> None:
    """One decode under torch.profiler; the top-40 ops by self CUDA time and by CPU time, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        decode()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    sections = [("CPU time", "cpu_time_total")]
    if cuda:
        sections.insert(0, ("self CUDA time", "self_device_time_total"))
    with open(path, "w", encoding="utf-8") as f:
        for title, key in sections:
            f.write(f"== top 40 by {title} ==\n{table.table(sort_by=key, row_limit=40)}\n\n")
    log(f"profile written to {path}")


def run_ours(mode, target, forced, ids, args, tree, device, gen_ref, results, inputs=None):
    """``inputs``: the model inputs beside ``ids`` (attention mask, images), as generate() takes them."""
    import eagle_mm

    # ours_default: the default call (the engine; CUDA graphs of its eager steps on CUDA); ours_compiled: the engine
    # compiled by inductor first; ours_eager: the engine's steps run eagerly.
    static = mode != "ours_eager"  # captured or compiled: warmed up twice
    options = {"ours_default": {}, "ours_compiled": dict(compile=compile_mode(args, device)),
               "ours_eager": dict(cache_implementation="dynamic")}[mode]

    def decode(profile=False):
        return eagle_mm.speculative_generate(target, forced, ids, max_new_tokens=args.new_tokens, do_sample=False,
                                             tree=tree, return_dict_in_generate=True, profile=profile,
                                             **(inputs or {}), **options)

    forced.set_accept(1)  # every proposal wrong: plain greedy decoding through our verify; compiles
    log(f"{mode}: reference decode (all proposals wrong){' + torch.compile warm-up' if static else ''}")
    out, sec = timed_call(decode, device=device)
    forced.set_reference(out.sequences)
    forced.draft_index.copy_(fit_draft_vocab(forced._head, torch.cat((out.sequences, gen_ref), 1)))
    results.add({"mode": mode, "phase": "reference", "seconds": sec,
                 "first_diff_vs_generate": first_diff(out.sequences, gen_ref, ids.shape[1])})
    if static and device.type == "cuda":
        decode()  # a second warm-up: the CUDA-graph trees record on their second call
    for tau in args.accept:
        forced.set_accept(tau)
        skips = cudagraph_skips()
        out, sec = timed_call(decode, device=device)
        n = out.sequences.shape[1] - ids.shape[1]
        # Decode rate: the tokens after the first over the time after it (the prefill's share apart), the rate
        # the plain-decode ceiling bounds.
        rate = (n - 1) / (sec - out.stats.time_prefill) if n > 1 else None
        results.add({"mode": mode, "accept": tau, "tokens_per_s": n / sec, "decode_tokens_per_s": rate,
                     "seconds": sec, "new_tokens": n,
                     "mean_accept_length": out.stats.mean_accept_length,
                     "target_forwards": out.stats.num_target_forwards,
                     "matches_generate": torch.equal(out.sequences.cpu(), gen_ref.cpu()),
                     "first_diff_vs_generate": first_diff(out.sequences, gen_ref, ids.shape[1]),
                     "compiled": options.get("compile") or False, "static_cache": True,
                     **per_cycle(out.stats), "cudagraph_skips": cudagraph_skips() - skips,
                     **device_per_cycle(decode(profile=True).stats)})
    if args.profile:
        if args.out is None:
            log(f"{mode}: --profile needs --out (the profile is written beside it); skipped")
            return
        forced.set_accept(args.accept[0])
        profile_decode(decode, device, f"{os.path.splitext(args.out)[0]}_profile_{mode}.txt")


def run_generate(mode, target, ids, args, device, results, gen_ref=None, inputs=None):
    """``inputs``: the model inputs beside ``ids`` (attention mask, images), as generate() takes them."""
    compiled = mode == "generate_compiled"
    generate = functools.partial(target.generate, ids, **(inputs or {}))
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if compiled:
        options["cache_implementation"] = "static"  # HF compiles the decode step with a static cache on CUDA
    log(f"{mode}: warm-up{' (torch.compile)' if compiled and device.type == 'cuda' else ''}")
    for _ in range(2 if compiled and device.type == "cuda" else 1):
        generate(**dict(options, max_new_tokens=args.new_tokens if compiled else 4,
                        min_new_tokens=args.new_tokens if compiled else 4))
    out, sec = timed_call(lambda: generate(**options), device=device)
    n = out.shape[1] - ids.shape[1]
    # The prefill's share: the same call for one token (its decode step never runs), best of three.
    first = min(timed_call(lambda: generate(**dict(options, max_new_tokens=1, min_new_tokens=1)), device=device)[1]
                for _ in range(3))
    row = {"mode": mode, "tokens_per_s": n / sec, "decode_tokens_per_s": (n - 1) / (sec - first) if n > 1 else None,
           "seconds": sec, "prefill_seconds": first, "new_tokens": n,
           "compiled": compiled and device.type == "cuda", "static_cache": compiled}
    if gen_ref is not None:
        row["matches_generate"] = torch.equal(out.cpu(), gen_ref.cpu())
        row["first_diff_vs_generate"] = first_diff(out, gen_ref, ids.shape[1])
    results.add(row)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    import eagle_mm
    import transformers

    device = torch.device("cpu" if args.tiny or args.qwen05b else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_8b.py needs a CUDA GPU (or --tiny for the CPU smoke run)")
    if args.tiny:
        args.new_tokens, args.prompt_len = min(args.new_tokens, 24), min(args.prompt_len, 12)
    depth = max(args.depth, min_depth(max(args.accept)))
    tree = (eagle_mm.TreeConfig.chain(depth) if args.chain
            else eagle_mm.TreeConfig(depth=depth, top_k=args.top_k, total_tokens=args.total_tokens))
    shape = "tiny" if args.tiny else "Qwen2.5-0.5B-shaped" if args.qwen05b else "8B-shaped"
    log(f"building the {shape} target and head on {device}")
    target, head = build(args, device)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "tiny": args.tiny, "layers": target.config.num_hidden_layers, "dtype": str(target.dtype),
            "draft_vocab": head.config.draft_vocab_size, "tree": dataclasses.asdict(tree),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "eagle_mm": eagle_mm.__version__}
    results = Results(args.out, meta)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (1, args.prompt_len), generator=g).to(device)

    if "ceiling" in args.modes:
        if device.type == "cuda":
            from bench_verify import copy_bandwidth

            weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
            bw = copy_bandwidth()
            results.add({"mode": "ceiling", "tokens_per_s": bw / weight_bytes, "copy_bandwidth_GBps": bw / 1e9,
                         "weight_GB": weight_bytes / 1e9})
        else:
            log("ceiling: skipped, the copy bandwidth is measured on CUDA only")
    # generate eager always runs: its tokens are the reference and the forcing's first draft vocabulary.
    gen_ref = run_generate("generate_eager", target, ids, args, device, results)
    reference = torch.cat((gen_ref.cpu(), gen_ref.new_zeros(1, depth + 4).cpu()), 1)
    forced = ForcedHead(head, reference.to(device), draft_index=fit_draft_vocab(head, gen_ref))
    for mode in args.modes:
        try:  # one failing mode (a compile error, say) must not cost the others their figures
            if mode in ("ours_default", "ours_compiled", "ours_eager"):
                if mode == "ours_compiled" and device.type != "cuda":
                    log(f"ours_compiled: on CPU torch.compile mode {compile_mode(args, device)} (no CUDA graphs)")
                run_ours(mode, target, forced, ids, args, tree, device, gen_ref, results)
            elif mode == "generate_compiled":
                if device.type != "cuda":
                    log("generate_compiled: on CPU generate() does not compile; timing its static cache only")
                run_generate(mode, target, ids, args, device, results, gen_ref)
        except Exception as e:  # noqa: BLE001 - reported in the results, then the next mode runs
            import traceback

            traceback.print_exc()
            results.add({"mode": mode, "error": f"{type(e).__name__}: {e}"[:2000]})
    summarize(results.data["rows"])
    log("done")
    return results.data


def summarize(rows) -> None:
    """A markdown table on stdout: tokens/s per mode and acceptance, against the ceiling and eager generate."""
    base = {r["mode"]: r["tokens_per_s"] for r in rows if "accept" not in r and "tokens_per_s" in r}
    ceiling, eager = base.get("ceiling"), base.get("generate_eager")
    print("| mode | forced accept | measured accept | tokens/s | x ceiling | x generate eager | decode tokens/s "
          "| decode x ceiling | = generate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        tps, dec = r["tokens_per_s"], r.get("decode_tokens_per_s")
        x_ceiling = f"{tps / ceiling:.2f}" if ceiling else "-"
        x_eager = f"{tps / eager:.2f}" if eager and r["mode"] != "ceiling" else "-"
        measured = f"{r['mean_accept_length']:.2f}" if "mean_accept_length" in r else "-"
        decode = "- | -" if dec is None else f"{dec:.1f} | " + (f"{dec / ceiling:.2f}" if ceiling else "-")
        print(f"| {r['mode']} | {r.get('accept', '-')} | {measured} | {tps:.1f} | {x_ceiling} | {x_eager} | {decode} "
              f"| {r.get('matches_generate', '-')} |")
    cycles = [r for r in rows if "cycle_ms" in r]
    if cycles:
        print("\nHost ms per cycle by phase")
        print("| mode | forced accept | cycle | draft | verify | other (update, read, commit) | CUDA-graph skips |")
        print("|---|---|---|---|---|---|---|")
        for r in cycles:
            print(f"| {r['mode']} | {r['accept']} | {r['cycle_ms']:.2f} | {r['draft_ms']:.2f} | "
                  f"{r['verify_ms']:.2f} | {r['other_ms']:.2f} | {r['cudagraph_skips']} |")
        floor = f"{1e3 / ceiling:.2f}" if ceiling else "-"
        print(f"\nDevice ms per cycle by phase (a call with profile=True; CUDA events), against the floor of one "
              f"weight read ({floor} ms)")
        print("| mode | forced accept | draft | verify | accept | update | host (the rest) |")
        print("|---|---|---|---|---|---|---|")
        for r in cycles:
            print(f"| {r['mode']} | {r['accept']} | " + " | ".join(
                f"{r[f'device_{k}_ms']:.2f}" for k in ("draft", "verify", "accept", "update", "host")) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
