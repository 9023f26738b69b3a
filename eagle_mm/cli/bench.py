"""`eagle-mm bench`: ``model.generate`` against ``speculative_generate`` (EAGLE, EAGLE-3) on the same prompts.

Greedy decoding, one process. Reported per method: tokens/s, the speed-up over ``generate``, the mean acceptance
length (``SpeculativeStats``: tokens per verify forward, bonus token included; 1.0 for plain ``generate``), the
acceptance rate per draft position, and whether the tokens equal ``generate``'s (they must, under greedy
decoding, but for a near-tie that bf16/fp16 rounding flips: ``eagle_mm.divergence`` tells the two apart). Each of
``repeats`` rounds times every (prompt, method) once, methods side by side, so a burst of load on a shared machine
hits every method of a round alike; the speed-up is the median of the rounds' speed-ups, reported with their range
and, when the range is too wide to tell, a warning that says so (``timing.Spread``).

The full comparison with HF prompt lookup and assisted generation, sampled as well as greedy, is
bench/bench_code_tiny.py; this module is the small, installed one behind the command line.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .util import add_tree_args, check_model_dir, quiet_loading, tree_kwargs
from .util import positive_int as _positive_int

__all__ = ["zoo_prompts", "timed", "run_benchmark", "format_table", "add_bench_parser", "run_bench"]

logger = logging.getLogger(__name__)

KINDS = ("eagle", "eagle3")  # the zoo model's heads, by attribute eagle_head / eagle3_head


def zoo_prompts(prompts: Sequence[str], count: int | None = None) -> list[str]:
    """The first ``count`` zoo validation prompts, trailing newlines removed.

    The zoo's prompts end at a ``def``/``class`` line and its newline. A lone newline token at the end is, in
    the training text, almost always the end of a file (indented lines start with a ``"\\n    "`` token), so the
    model would often stop at once; without it, the model writes the body.
    """
    chosen = list(prompts if count is None else prompts[:count])
    return [p.rstrip("\n") for p in chosen]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable):
    """(fn(), seconds), the device synchronised around it."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def _runners(target, heads: dict, tree, max_new_tokens: int) -> dict[str, Callable]:
    """name -> fn(enc, max_new_tokens) -> (sequences, SpeculativeStats or None); generate first. tree None: each
    call drafts the default call's tree."""
    from ..decode.loop import speculative_generate

    def plain(enc, n):
        return target.generate(**enc, max_new_tokens=n, do_sample=False), None

    def speculative(head):
        def run(enc, n):
            out = speculative_generate(target, head, **enc, max_new_tokens=n, do_sample=False, tree=tree,
                                       return_dict_in_generate=True)
            return out.sequences, out.stats
        return run

    return {"generate": plain, **{name: speculative(head) for name, head in heads.items()}}


def _empty_totals() -> dict:
    return {"new_tokens": 0, "rounds": [], "drafts": 0, "accepted": 0, "forwards": 0, "counts": [], "verdicts": [],
            "trees": []}


def _add_stats(totals: dict, stats) -> None:
    totals["drafts"] += stats.num_drafts
    totals["accepted"] += stats.accepted_tokens
    totals["forwards"] += stats.num_target_forwards
    counts = totals["counts"]
    counts.extend([0] * (len(stats.accept_counts) - len(counts)))
    for i, c in enumerate(stats.accept_counts):
        counts[i] += c
    tree = _tree_dict(stats.tree)
    if tree not in totals["trees"]:
        totals["trees"].append(tree)


def _tree_dict(tree) -> dict:
    return {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens}


def run_benchmark(target, tokenizer, heads: dict, prompts: Sequence[str], *, max_new_tokens: int = 64, tree=None,
                  repeats: int = 3, progress: bool | None = None) -> dict:
    """Time greedy ``generate`` and ``speculative_generate`` with each head on ``prompts``.

    heads: method name -> attached draft head. tree: a ``TreeConfig``, or None for the tree the default call
    drafts. repeats: timed rounds over all prompts and methods (the speed-up is their median). progress: a tqdm bar
    on stderr (None: only on a terminal). Returns ``{"meta": {...}, "rows": [one dict per method]}``.
    """
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("no prompts to benchmark; pass at least one")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    if "generate" in heads:
        raise ValueError("'generate' names the plain-decoding baseline; give that head another name")
    device = target.device
    runners = _runners(target, heads, tree, max_new_tokens)
    # Only what every causal LM takes: some tokenizers add token_type_ids, which generate() would pass on.
    encs = [{k: v.to(device) for k, v in tokenizer(p, return_tensors="pt").items()
             if k in ("input_ids", "attention_mask")} for p in prompts]
    for run in runners.values():  # untimed warm-up: lazy inits, allocator, kernels
        run(encs[0], min(8, max_new_tokens))
    totals = {name: _empty_totals() for name in runners}
    bar = tqdm(total=len(encs) * len(runners) * repeats, desc="bench", unit="run", file=sys.stderr,
               disable=None if progress is None else not progress)
    with bar:
        for round_ in range(repeats):
            for t in totals.values():
                t["rounds"].append(0.0)
            for enc in encs:
                _time_prompt(target, runners, enc, max_new_tokens, totals, first=round_ == 0)
                bar.update(len(runners))
    rows = [_row(name, t, len(encs)) for name, t in totals.items()]
    _speedups(rows, totals)
    trees = [row["tree"] for row in rows[1:]]
    meta = {"device": str(device), "dtype": str(target.dtype), "prompts": len(encs), "max_new_tokens": max_new_tokens,
            "repeats": repeats, "tree": trees[0] if trees and all(t == trees[0] for t in trees) else None,
            "tree_given": tree is not None, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__}
    logger.info("benchmarked %d method(s) on %d prompt(s), %d round(s)", len(rows), len(encs), repeats)
    return {"meta": meta, "rows": rows}


def _time_prompt(target, runners: dict, enc: dict, max_new_tokens: int, totals: dict, *, first: bool) -> None:
    """One timed run of every method on one prompt, added to the current round; the first round also counts the
    tokens and acceptance (greedy decoding repeats them exactly) and compares the tokens with generate's."""
    from ..divergence import compare_greedy

    reference = None
    prompt_length = enc["input_ids"].shape[1]
    for name, run in runners.items():
        (sequences, stats), seconds = timed(target.device, lambda: run(enc, max_new_tokens))
        t = totals[name]
        t["rounds"][-1] += seconds
        if not first:
            continue
        t["new_tokens"] += sequences.shape[1] - prompt_length
        if reference is None:
            reference = sequences
        else:
            t["verdicts"].append(compare_greedy(target, reference, sequences, prompt_length))
            _add_stats(t, stats)


def _speedups(rows: list[dict], totals: dict) -> None:
    """Per row: each round's speed-up over generate's in the same round, their median and range."""
    from .timing import Spread

    base = totals["generate"]
    for row in rows:
        t = totals[row["method"]]
        # Per token: with an EOS the methods' lengths could differ.
        ratios = [(t["new_tokens"] / s) / (base["new_tokens"] / b) for s, b in zip(t["rounds"], base["rounds"])]
        spread = Spread.of(ratios)
        row.update(speedup=spread.median, speedup_low=spread.low, speedup_high=spread.high,
                   speedup_rounds=ratios, noisy=spread.noisy if row["method"] != "generate" else False)


def _row(name: str, t: dict, prompts: int) -> dict:
    speculative = name != "generate"
    seconds = statistics.median(t["rounds"])
    return {
        "method": name, "prompts": prompts, "new_tokens": t["new_tokens"], "seconds": seconds,
        "tokens_per_s": t["new_tokens"] / seconds,
        # plain decoding: one token per target forward, and nothing drafted
        "mean_accept_length": t["accepted"] / t["drafts"] if speculative and t["drafts"] else 1.0,
        "accept_rate_per_position": [c / t["drafts"] for c in t["counts"]] if t["drafts"] else [],
        "target_forwards": t["forwards"] if speculative else None,
        "tree": (t["trees"][0] if len(t["trees"]) == 1 else t["trees"]) if speculative else None,
        "matches_generate": all(v.verdict == "identical" for v in t["verdicts"]) if speculative else None,
        # per prompt that differs: a near-tie (rounding) or a MISMATCH (a bug)
        "divergences": {i: str(v) for i, v in enumerate(t["verdicts"]) if v.verdict != "identical"},
        "mismatch": any(v.is_mismatch for v in t["verdicts"]),
    }


def _tree_text(tree) -> str:
    if isinstance(tree, list):
        return "; ".join(_tree_text(t) for t in tree)
    return f"depth={tree['depth']}, top_k={tree['top_k']}, total_tokens={tree['total_tokens']}"


def format_table(result: dict) -> str:
    """The rows as a plain-text table, one line per method, the tree and sizes above, warnings below."""
    from .timing import Spread

    meta = result["meta"]
    rounds = meta["repeats"]
    if meta["tree"] is not None:
        trees = [f"tree {_tree_text(meta['tree'])}" + ("" if meta.get("tree_given", True) else " (the default "
                                                                                                 "call's)")]
    else:
        trees = [f"{r['method']}: tree {_tree_text(r['tree'])}" for r in result["rows"][1:]]
    lines = [f"{meta['prompts']} prompt(s), {meta['max_new_tokens']} new tokens each, greedy, {meta['device']} "
             f"{meta['dtype']}, speed-up: the median of {rounds} round(s)' speed-ups; " + "; ".join(trees),
             f"{'method':12} {'tok/s':>8} {'speed-up':>9} {'accept':>7} {'match':>6} {'range':>13}  "
             f"accept rate per position"]
    notes = []
    for r in result["rows"]:
        # yes: identical tokens; tie: they differ only after a near-tie the dtype cannot resolve; NO: a mismatch
        match = "-" if r["matches_generate"] is None else "NO" if r["mismatch"] else "yes" if r["matches_generate"] \
            else "tie"
        rates = "[" + ", ".join(f"{x:.2f}" for x in r["accept_rate_per_position"]) + "]"
        speculative = r["matches_generate"] is not None
        span = f"{r['speedup_low']:.2f}-{r['speedup_high']:.2f}x" if speculative and rounds > 1 else "-"
        lines.append(f"{r['method']:12} {r['tokens_per_s']:8.1f} {r['speedup']:8.2f}x {r['mean_accept_length']:7.2f} "
                     f"{match:>6} {span:>13}  {rates if r['accept_rate_per_position'] else '-'}")
        notes += [f"{r['method']}, prompt {i}: {text}" for i, text in r.get("divergences", {}).items()]
        if speculative:
            spread = Spread(r["speedup"], r["speedup_low"], r["speedup_high"], rounds)
            warning = spread.warning("pass more --repeats (or more --max-new-tokens)")
            notes += [f"{r['method']}: {warning}"] if warning else []
    return "\n".join(lines + notes)


# ---- `eagle-mm bench` -----------------------------------------------------------------------------
def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare `eagle-mm bench`; its handler is ``run_bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="time generate against speculative decoding (tokens/s, speed-up, acceptance)",
        description=(
            "Decode greedily with model.generate and with eagle_mm.speculative_generate and each draft head, on the "
            "same prompts in one process; print tokens/s, the speed-up over generate, the mean acceptance length, "
            "the acceptance rate per draft position and whether the tokens are identical. Default: the shipped "
            "reference model code-tiny (its EAGLE and EAGLE-3 heads, its validation prompts). Or your own: "
            "--target DIR --head DIR [--head DIR ...] --prompt TEXT [--prompt TEXT ...]."
        ),
    )
    parser.add_argument("--target", metavar="DIR", help="local target model directory or .gguf file (default: the "
                        "zoo's code-tiny)")
    parser.add_argument("--head", action="append", metavar="DIR", help="draft head directory, with --target "
                        "(repeat to compare heads); loaded in the target's dtype")
    parser.add_argument("--zoo-dir", metavar="DIR", help="a zoo model directory (default: code-tiny as eagle_mm.zoo "
                        "finds it: $EAGLE_MM_ZOO_DIR/code-tiny or the shipped one)")
    parser.add_argument("--kind", nargs="+", choices=KINDS, default=None,
                        help="zoo model only: which of its heads to run (default: both)")
    parser.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; default: the zoo "
                        "model's validation prompts)")
    parser.add_argument("--num-prompts", type=_positive_int, default=4, help="zoo validation prompts used (default 4)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64)
    parser.add_argument("--repeats", type=_positive_int, default=3, help="timed rounds over the prompts and methods; "
                        "the speed-up is their median, shown with its range (default 3)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="target dtype; the heads follow it (auto: float32 on a CPU, where bf16 matmuls are "
                             "slow; on a GPU the checkpoint's, bf16 for the zoo model)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE ('-': stdout, "
                        "instead of the table)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tree_args(parser, "draft tree (default: the tree speculative_generate's default call drafts)")
    parser.set_defaults(func=run_bench)


def _fail(message: str) -> int:
    print(f"eagle-mm bench: error: {message}", file=sys.stderr)
    return 2


def _check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, before anything is loaded."""
    if args.target is None:
        if args.head:
            return "--head needs --target (the model the head drafts for); without both, the zoo model runs"
    else:
        if args.zoo_dir is not None or args.kind is not None:
            return "--zoo-dir and --kind pick the zoo model; with --target, pass its heads with --head DIR"
        if not args.head:
            return "--target needs at least one --head DIR to compare against generate"
        if not args.prompt:
            return "--target needs at least one --prompt TEXT (the zoo's prompts are for the zoo model)"
        problem = check_model_dir(args.target, "--target")
        if problem:
            return problem
        for path in args.head:
            if not Path(path).is_dir():
                return f"no such directory: {path}; pass --head a local directory"
    if args.zoo_dir is not None and not Path(args.zoo_dir).is_dir():
        return f"no such directory: {args.zoo_dir}; pass --zoo-dir a zoo model directory (it holds manifest.json)"
    if args.prompt and any(not p for p in args.prompt):
        return "--prompt '' is empty; pass some text"
    return None


def _load(args: argparse.Namespace):
    """(target, tokenizer, {method: head}, prompts)."""
    from .. import zoo

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.target is None:
        model = (zoo.load_dir(args.zoo_dir, device=args.device, dtype=dtype) if args.zoo_dir is not None
                 else zoo.load("code-tiny", device=args.device, dtype=dtype))
        prompts = args.prompt or zoo_prompts(model.prompts, args.num_prompts)
        if not prompts:
            raise ValueError(f"{model.path} has no prompts.json; pass --prompt TEXT")
        heads = {kind: getattr(model, f"{kind}_head") for kind in (args.kind or KINDS)}
        return model.target, model.tokenizer, heads, prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..heads.io import load_head
    from ..hf.gguf import model_source

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else "auto"
    source = model_source(args.target)  # a GGUF file's converted folder
    tokenizer = AutoTokenizer.from_pretrained(source)
    # sdpa: flash-attention kernels cannot take the tree mask.
    target = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa",
                                                  device_map=device).eval()
    heads = {}
    for path in args.head:
        name = Path(path).resolve().name
        while name in heads or name == "generate":
            name += "'"
        # The target's dtype: a bf16 head beside an fp32 target on a CPU would run bf16 matmuls, which are slow.
        heads[name] = load_head(path, target=target, dtype=target.dtype)
    return target, tokenizer, heads, list(args.prompt)


def run_bench(args: argparse.Namespace) -> int:
    """Handler of `eagle-mm bench`; returns the exit status."""
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    from ..config import TreeConfig

    quiet_loading(False)  # transformers' loading bars are noise above the table
    given = tree_kwargs(args)
    try:
        explicit = TreeConfig(**given) if given else None
        target, tokenizer, heads, prompts = _load(args)
    except FileNotFoundError as exc:
        hint = "" if args.target else "; or benchmark your own model with --target DIR --head DIR --prompt TEXT"
        return _fail(f"{exc}{hint}")
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    result = run_benchmark(target, tokenizer, heads, prompts, max_new_tokens=args.max_new_tokens,
                           tree=explicit, repeats=args.repeats,
                           progress=False if args.no_progress else None)
    result["meta"]["model"] = args.target or "code-tiny"
    text = json.dumps(result, indent=1) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        print(format_table(result))
        if args.json:
            Path(args.json).write_text(text, encoding="utf-8")
            print(f"wrote {args.json}")
    mismatched = [r["method"] for r in result["rows"] if r.get("mismatch")]
    if mismatched:
        print(f"eagle-mm bench: error: {', '.join(mismatched)} differ from model.generate(do_sample=False) where no "
              "near-tie explains it; greedy speculative decoding must reproduce it token for token", file=sys.stderr)
        return 1
    return 0
