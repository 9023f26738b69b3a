"""The default call against HF generate, path by path, every row in one process.

code-tiny (its validation prompts, repeated to fill a batch): greedy and sampled (T=0.8, top_p=0.95) at batch 1,
4, 16, 32 and 64, and "ragged" batch 16: greedy rows that stop at their first blank line
(``stop_strings=["\n\n"]``, the end of a block), so most rows stop within ~30 tokens and a few run to the end; it
also times ours with the batch kept whole (column ``ours_whole_batch``), which is what finished rows cost without
the engine dropping them. Columns: ``model.generate`` eager (``hf_eager``) and with
``cache_implementation="static"`` (``hf_static``: HF compiles it on CUDA), ours as the default call (``ours``: the
chooser picks the tree, or no tree, from the costs it measured here, the first call of a process measuring what
the cost file lacks) and ours with ``compile=True`` (``ours_compile``), and the tree the chooser picked (with
its switches as rows finished, and the expected rates of its finalists in the JSON). Each method is called once
untimed first (its first call's cost is reported as its own column), then timed ``--repeats`` times, HF eager,
HF static and ours in turns (a machine whose load drifts weighs on them alike; median; ours
also records what each timed call spent capturing graphs or compiling, ``timed_setup_s``, and per call, the
untimed one first, its trees, phases and first choice, ``calls``). Per row: tokens/s, the
ratio to HF eager, HF static and the faster of the two (``x best``), mean acceptance, and for greedy rows
losslessness: identical, or each diverging row classified as a near-tie (the reference's top-2 logits at the first
difference within the dtype's resolution) or a MISMATCH.

On a CPU the rows of 32 and 64 decode ``--cpu-large-tokens`` new tokens (default 32) instead of ``--new-tokens``,
so that the whole run stays within minutes; the output says so per row (``new_tokens``).

    PYTHONPATH=. python bench/bench_matrix.py --out matrix.json            # GPU: bf16; CPU: fp32
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time

import torch

BATCHES = (1, 4, 16, 32, 64)
ROWS = [(mode, b) for b in BATCHES for mode in ("greedy", "sampled")] + [("ragged", 16)]
METHODS = ("hf_eager", "hf_static", "ours", "ours_compile")
SCENES_ROWS = [("greedy", 1), ("sampled", 1), ("greedy", 4)]


def scenes_batch(zm, examples: list) -> dict:
    """One picture and question per row, left-padded into one batch (LLaVA: one image per row)."""
    rows = [zm.inputs(ex["image"], ex["prompt"]) for ex in examples]
    width = max(r["input_ids"].shape[1] for r in rows)
    pad = zm.tokenizer.pad_token_id or 0

    def left(x, value):
        return torch.cat((x.new_full((1, width - x.shape[1]), value), x), 1)

    return {"input_ids": torch.cat([left(r["input_ids"], pad) for r in rows]),
            "attention_mask": torch.cat([left(r["attention_mask"], 0) for r in rows]),
            "pixel_values": torch.cat([r["pixel_values"] for r in rows])}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t


def classify(model, ref32, ours: torch.Tensor, ref: torch.Tensor, prompt_len: int, pads: list[int]) -> list[str]:
    """Per row: "identical", "near-tie at i" or "MISMATCH at i", i the first new token that differs.

    A near-tie: the two tokens' logits at i are closer in an fp32 copy of the target (``ref32``, None when the
    target is fp32) than twice the error the target's own dtype makes on them there, so rounding can order them
    either way; "reference off" when the fp32 copy prefers our token (the reference's batch rounding flipped it).
    In fp32 every divergence is a MISMATCH. ``pads``: each row's left padding."""
    out = []
    for b in range(ours.shape[0]):
        n = min(ours.shape[1], ref.shape[1])
        diff = (ours[b, :n] != ref[b, :n]).nonzero()
        if diff.numel() == 0:
            out.append("identical")
            continue
        i = int(diff[0])
        pair = torch.stack((ours[b, i], ref[b, i]))
        if ref32 is None:  # fp32: any divergence is a mismatch; an image prompt: no text-only prefix to check
            out.append(f"MISMATCH at {i - prompt_len}" if model.dtype == torch.float32 else
                       f"diverges at {i - prompt_len} (not classified: image prompt)")
            continue
        prefix = ref[b, pads[b]: i][None]  # the row without its left padding
        with torch.no_grad():
            low = model(input_ids=prefix).logits[0, -1].float()[pair]
            exact = ref32(input_ids=prefix).logits[0, -1].float()[pair]
        err, margin = float((low - exact).abs().max()), float(exact[0] - exact[1])  # > 0: fp32 prefers ours
        kind = ("near-tie" if abs(margin) <= 2 * err else
                "reference off (fp32 prefers ours)" if margin > 0 else "MISMATCH")
        out.append(f"{kind} at {i - prompt_len} (fp32 margin {margin:.3g}, {model.dtype} error {err:.3g})")
    return out


def _new_tokens(ref: torch.Tensor, prompt_len: int, pad: int | None, stops: bool) -> int:
    """New tokens in ``ref`` (B, T): every column, or with stops each row's up to its last non-padding token."""
    new = ref[:, prompt_len:]
    if not stops or pad is None:
        return new.numel()
    real = (new != pad).long()
    last = real.shape[1] - real.flip(1).argmax(1)  # one past each row's last real token
    return int(torch.where(real.any(1), last, 0).sum())


def _whole_batch(call):
    """Ours with finished rows kept in the batch (the loop's compaction plan patched out): a comparison only."""
    from eagle_mm.decode import loop

    plan = loop.plan
    loop.plan = lambda *a: None
    try:
        return call()
    finally:
        loop.plan = plan


def _tree_path(stats) -> str:
    """The trees a call of ours ran: its first, then each switch at the batch it was made for."""
    if not stats.choices:
        return str(_short(stats.tree))
    path = [_short(stats.choices[0].tree)]
    for c in stats.choices[1:]:
        if _short(c.tree) != path[-1].split("@")[0]:
            path.append(f"{_short(c.tree)}@{c.batch}")
    return " > ".join(path)


def _short(tree) -> str:
    return "none" if not tree.drafts else f"{tree.depth}/{tree.top_k}/{tree.total_tokens}"


def _time_methods(fns: dict, device, repeats: int, turns: tuple = ("hf_eager", "hf_static", "ours")) -> dict:
    """Each method called once untimed, then ``repeats`` timed calls; the methods of ``turns`` take their timed calls
    in turns (a machine whose load drifts, as a GPU host's CPU beside GPU work does, weighs on them alike), the others
    after them, one method at a time (compiled steps, or a patched loop, between two of ours would change them)."""
    got = {}
    for name, fn in fns.items():
        out, first = timed(fn, device)
        got[name] = {"out": out, "first_call_s": first, "secs": [], "setups": [],
                     "calls": [_call_record(out, first)] if hasattr(out, "stats") else []}
    rounds = [[n for n in fns if n in turns]] * repeats + [[n] * repeats for n in fns if n not in turns]
    for names in rounds:
        for name in names:
            out, sec = timed(fns[name], device)
            g = got[name]
            g["out"] = out
            g["secs"].append(sec)
            if hasattr(out, "stats"):  # ours: what a timed call still spent capturing or compiling
                g["setups"].append(out.stats.time_compile)
                g["calls"].append(_call_record(out, sec))
    result = {}
    for name, g in got.items():
        r = {"out": g["out"], "first_call_s": g["first_call_s"], "median_s": statistics.median(g["secs"]),
             "timed_setup_s": g["setups"]}
        result[name] = {**r, "calls": g["calls"]} if g["calls"] else r
    return result


def _call_record(out, seconds: float) -> dict:
    """One call of ours, untimed first one included: its trees, its phases' seconds, its choices (first, later)."""
    s = out.stats
    return {"s": seconds, "tree": _tree_path(s), "setup_s": s.time_compile, "prefill_s": s.time_prefill,
            "draft_s": s.time_draft, "verify_s": s.time_verify, "other_s": s.time_other,
            "forwards": s.num_target_forwards, "accept": s.mean_accept_length,
            "first_choice": s.choices[0].as_dict() if s.choices else None,
            "later_choices": [c.as_dict() for c in s.choices[1:]]}


def _row(args, m, model, head, mode, batch, device, scenes, examples, ref32) -> dict:
    import eagle_mm

    tok = m.tokenizer
    if scenes:
        enc = scenes_batch(m, examples[:batch])
    else:
        prompts = (m.prompts * ((batch // len(m.prompts)) + 1))[:batch]
        enc = dict(tok(prompts, return_tensors="pt", padding=True).to(device))
    n = args.new_tokens
    if device.type == "cpu" and batch >= 32 and not scenes:
        n = min(n, args.cpu_large_tokens)
    sample = dict(do_sample=True, temperature=0.8, top_p=0.95) if mode == "sampled" else dict(do_sample=False)
    # code-tiny: every row decodes n tokens (code rarely ends early) except in the ragged row, whose rows stop at a
    # blank line; scenes-tiny: answers end at their eos, as the VLM was trained (past it the head has nothing to
    # predict).
    ends = {} if scenes else dict(stop_strings=["\n\n"], tokenizer=tok) if mode == "ragged" else dict(min_new_tokens=n)
    common = dict(**enc, max_new_tokens=n, **ends, **sample)
    seed = [0]

    def gen():
        seed[0] += 1
        return torch.Generator(device).manual_seed(seed[0])

    methods = {
        "hf_eager": lambda: model.generate(**common),
        "hf_static": lambda: model.generate(**common, cache_implementation="static"),
        "ours": lambda: eagle_mm.speculative_generate(model, head, **common, generator=gen(),
                                                      return_dict_in_generate=True),
        "ours_compile": lambda: eagle_mm.speculative_generate(model, head, **common, generator=gen(), compile=True,
                                                              return_dict_in_generate=True),
    }
    methods = {k: v for k, v in methods.items() if k in args.methods}
    if mode == "ragged" and "ours" in methods:
        methods["ours_whole_batch"] = lambda: _whole_batch(methods["ours"])
    row, outs = {"mode": mode, "batch": batch, "new_tokens": n}, {}
    for name, got in _time_methods(methods, device, args.repeats).items():
        out = got.pop("out")
        outs[name] = out.sequences if hasattr(out, "sequences") else out
        # Tokens decoded: each row's up to its stop (the reference's, the same for every lossless method).
        ref = outs.get("hf_eager", outs[name])
        tokens = _new_tokens(ref, enc["input_ids"].shape[1], getattr(tok, "pad_token_id", None), mode == "ragged")
        row[name] = {"tokens_per_s": tokens / got["median_s"], **got}
        if hasattr(out, "stats"):
            row[name].update(mean_accept_length=out.stats.mean_accept_length, engine=out.stats.engine,
                             mode=out.stats.mode, tree=_tree_path(out.stats),
                             choices=[c.as_dict() for c in out.stats.choices[:3]])
        else:
            del row[name]["timed_setup_s"]
    hf = [row[k]["tokens_per_s"] for k in ("hf_eager", "hf_static") if k in row]
    for name in ("ours", "ours_compile", "ours_whole_batch"):
        if name in row:
            for base in ("hf_eager", "hf_static"):
                if base in row:
                    row[name][f"x_{base}"] = row[name]["tokens_per_s"] / row[base]["tokens_per_s"]
            if hf:
                row[name]["x_best_hf"] = row[name]["tokens_per_s"] / max(hf)
    if mode in ("greedy", "ragged") and "hf_eager" in outs:
        pads = (enc["attention_mask"] == 0).sum(1).tolist()
        for name in ("ours", "ours_compile"):
            if name in outs:
                row[name]["lossless"] = classify(model, ref32, outs[name], outs["hf_eager"],
                                                 enc["input_ids"].shape[1], pads)
    return row


def _summary(rows: list) -> None:
    print(f"{'row':<10} {'tokens':>6} {'hf eager':>9} {'hf static':>9} {'ours':>9} {'x best':>7} {'compile':>9} "
          f"{'x best':>7} {'accept':>6}  tree")
    for r in rows:
        def rate(k):
            return f"{r[k]['tokens_per_s']:9.1f}" if k in r else f"{'-':>9}"

        def best(k):
            return f"{r[k]['x_best_hf']:7.2f}" if k in r and "x_best_hf" in r[k] else f"{'-':>7}"
        ours = r.get("ours", {})
        lossless = sorted({v.split(' ')[0] for k in ('ours', 'ours_compile') for v in r.get(k, {}).get('lossless', [])})
        print(f"{r['mode'] + str(r['batch']):<10} {r['new_tokens']:>6} {rate('hf_eager')} {rate('hf_static')} "
              f"{rate('ours')} {best('ours')} {rate('ours_compile')} {best('ours_compile')} "
              f"{ours.get('mean_accept_length', float('nan')):6.2f}  {ours.get('tree', '')}  {' '.join(lossless)}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("code-tiny", "scenes-tiny"), default="code-tiny")
    p.add_argument("--new-tokens", type=int, default=None, help="default: 128 (code-tiny), 48 (scenes-tiny)")
    p.add_argument("--cpu-large-tokens", type=int, default=32,
                   help="on a CPU, new tokens of the rows of batch 32 and 64 (to stay within minutes)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rows", nargs="+", default=None, help="e.g. greedy1 sampled64 ragged16 (default: all)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import transformers

    from eagle_mm import zoo

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scenes = args.model == "scenes-tiny"
    args.new_tokens = args.new_tokens or (48 if scenes else 128)
    m = zoo.load(args.model, device=device)
    model, tok = m.target, m.tokenizer
    head = m.head if scenes else m.eagle3_head
    ref32 = None if model.dtype == torch.float32 or scenes else copy.deepcopy(model).float()
    examples = None
    if scenes:
        from eagle_mm.zoo import scenes_data as sd

        examples = list(sd.examples("validation", 64, size=m.image_size, tasks=["caption"]))  # answers of a sentence
    else:
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    meta = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else
            platform.processor() or "cpu", "threads": torch.get_num_threads(), "dtype": str(model.dtype),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "new_tokens": args.new_tokens, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d")}
    if device.type == "cpu":
        meta["note"] = f"CPU: rows of batch 32 and 64 decode {min(args.new_tokens, args.cpu_large_tokens)} new tokens"
        print(meta["note"], flush=True)
    wanted = args.rows or [f"{mode}{b}" for mode, b in (SCENES_ROWS if scenes else ROWS)]
    rows, start = [], time.perf_counter()
    for mode, batch in SCENES_ROWS if scenes else ROWS:
        if f"{mode}{batch}" not in wanted:
            continue
        row = _row(args, m, model, head, mode, batch, device, scenes, examples, ref32)
        row["elapsed_s"] = time.perf_counter() - start
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    _summary(rows)
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
