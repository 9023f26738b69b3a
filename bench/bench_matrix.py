"""The default call against HF generate, path by path, every row in one process.

On the shipped code-tiny (its validation prompts, 128 new tokens): greedy batch 1, sampled (T=0.8, top_p=0.95)
batch 1, greedy batch 4, greedy batch 16, sampled batch 4, and "ragged" batch 16: greedy rows that stop at their
first blank line (``stop_strings=["\n\n"]``, the end of a block), so most rows stop within ~30 tokens and a few
run to 128; it also times ours with the batch kept whole (column ``ours_whole_batch``), which is what finished
rows cost without the engine dropping them. Baselines: ``model.generate`` eager and with
``cache_implementation="static"`` (which compiles on CUDA). Each method is called once untimed first (its first
call's cost is reported as its own column), then timed ``--repeats`` times (median; ours also records what each
timed call spent capturing graphs, ``timed_setup_s``: a batch whose rows shrink to a size no earlier call reached
captures it first). Per row: tokens/s, the ratio
to both baselines, mean acceptance, and for greedy rows losslessness: identical, or each diverging row classified
as a near-tie (the reference's top-2 logits at the first difference within the dtype's resolution) or a MISMATCH.

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

ROWS = [("greedy", 1), ("sampled", 1), ("greedy", 4), ("greedy", 16), ("sampled", 4), ("ragged", 16)]
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("code-tiny", "scenes-tiny"), default="code-tiny")
    p.add_argument("--new-tokens", type=int, default=None, help="default: 128 (code-tiny), 48 (scenes-tiny)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", nargs="+", default=[f"{m}{b}" for m, b in ROWS])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import transformers

    import eagle_mm
    from eagle_mm import zoo

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scenes = args.model == "scenes-tiny"
    args.new_tokens = args.new_tokens or (48 if scenes else 128)
    m = zoo.load(args.model, device=device)
    model, tok = m.target, m.tokenizer
    head = m.head if scenes else m.eagle3_head
    ref32 = None if model.dtype == torch.float32 or scenes else copy.deepcopy(model).float()
    if scenes:
        from eagle_mm.zoo import scenes_data as sd

        examples = list(sd.examples("validation", 16, size=m.image_size, tasks=["caption"]))  # answers of a sentence
    else:
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    meta = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "dtype": str(model.dtype), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d")}
    rows = []
    for mode, batch in SCENES_ROWS if scenes else ROWS:
        if f"{mode}{batch}" not in args.rows:
            continue
        if scenes:
            enc = scenes_batch(m, examples[:batch])
        else:
            prompts = (m.prompts * ((batch // len(m.prompts)) + 1))[:batch]
            enc = dict(tok(prompts, return_tensors="pt", padding=True).to(device))
        n = args.new_tokens
        sample = dict(do_sample=True, temperature=0.8, top_p=0.95) if mode == "sampled" else dict(do_sample=False)
        # code-tiny: every row decodes n tokens (code rarely ends early) except in the ragged row, whose rows stop at
        # a blank line; scenes-tiny: answers end at their eos, as the VLM was trained (past it the head has nothing
        # to predict).
        ends = {} if scenes else dict(stop_strings=["\n\n"], tokenizer=tok) if mode == "ragged" else \
            dict(min_new_tokens=n)
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
        }
        if mode == "ragged":
            methods["ours_whole_batch"] = lambda: _whole_batch(methods["ours"])
        row = {"mode": mode, "batch": batch}
        outs = {}
        for name, fn in methods.items():
            out, first = timed(fn, device)
            secs, setups = [], []
            for _ in range(args.repeats):
                out, sec = timed(fn, device)
                secs.append(sec)
                if hasattr(out, "stats"):  # ours: what a timed call still spent capturing or compiling
                    setups.append(out.stats.time_compile)
            seqs = out.sequences if hasattr(out, "sequences") else out
            outs[name] = seqs
            # Tokens decoded: each row's up to its stop (the reference's, the same for every lossless method).
            tokens = _new_tokens(outs["hf_eager"], enc["input_ids"].shape[1], getattr(tok, "pad_token_id", None),
                                 mode == "ragged")
            row[name] = {"tokens_per_s": tokens / statistics.median(secs), "first_call_s": first,
                         "median_s": statistics.median(secs)}
            if name == "ours":
                row[name].update(mean_accept_length=out.stats.mean_accept_length, engine=out.stats.engine,
                                 mode=out.stats.mode, tree=str(out.stats.tree), timed_setup_s=setups)
        ours = row["ours"]["tokens_per_s"]
        row["vs_hf_eager"] = ours / row["hf_eager"]["tokens_per_s"]
        row["vs_hf_static"] = ours / row["hf_static"]["tokens_per_s"]
        if "ours_whole_batch" in row:
            row["vs_whole_batch"] = ours / row["ours_whole_batch"]["tokens_per_s"]
        if mode in ("greedy", "ragged"):
            row["lossless"] = classify(model, ref32, outs["ours"], outs["hf_eager"], enc["input_ids"].shape[1],
                                     (enc["attention_mask"] == 0).sum(1).tolist())
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'row':<10} {'hf eager':>9} {'hf static':>9} {'ours':>9} {'x eager':>8} {'x static':>8} {'accept':>6}")
    for r in rows:
        print(f"{r['mode'] + str(r['batch']):<10} {r['hf_eager']['tokens_per_s']:9.1f} "
              f"{r['hf_static']['tokens_per_s']:9.1f} {r['ours']['tokens_per_s']:9.1f} {r['vs_hf_eager']:8.2f} "
              f"{r['vs_hf_static']:8.2f} {r['ours']['mean_accept_length']:6.2f}  {r.get('lossless', '')}")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
