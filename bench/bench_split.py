"""Greedy speculative decoding on a target split over two devices by a device_map.

The target's input embeddings and first layers sit on the first device; the other layers, the final norm and
the lm_head on the second: two GPUs (``--devices cuda:0 cuda:1``), a GPU and the CPU (``cuda:0 cpu``: those
modules are offloaded the way ``from_pretrained(device_map=...)`` offloads them: weights in host memory, run on
the GPU behind accelerate's hooks), or, for CPU test runs, the CPU and the disk. The EAGLE-3 head's captured
layers fall on both sides of the split. The target is built from its config with random weights, then placed
either by ``accelerate.dispatch_model`` (``--via dispatch``) or saved and loaded back with
``from_pretrained(device_map=...)`` (``--via pretrained``, what users do).

Per dtype, ``model.generate(do_sample=False)`` is the reference; ``speculative_generate`` must give the same
tokens with (1) a forced-acceptance head (the real head with its proposals replaced by the reference
continuation, 20% of them made wrong: ``bench/forced.py``) and (2) the untrained head. Tokens/s of each,
acceptance, and peak memory per GPU are written to --out after each dtype.

Why float32 as well as bfloat16: random weights give flat logits, and among 128k of them the top two are
often within one bf16 rounding step; the tree verify forward (many query tokens) and generate's one-token
forward round differently, so in bf16 greedy choices at such near-ties can differ without any error in the
algorithm. float32 is the exact check; for bf16, a mismatch is reported with the top-2 logit gap of the
reference at that token (a gap of a few bf16 steps is such a tie).

    python bench/bench_split.py --shape 8b --devices cuda:0 cuda:1 --via dispatch --out split.json
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_multi_gpu import SHAPES, build_target
from bench.forced import ForcedHead
from bench.harness import sync, timed_call

logger = logging.getLogger("bench_split")


def device_map(num_layers: int, devices: list[str], split: float) -> dict:
    """Embeddings and the first ``split`` of the layers on devices[0]; the rest, norm and lm_head on devices[1]."""
    first, second = devices
    k = round(num_layers * split)
    dm = {"model.embed_tokens": first, "model.rotary_emb": first}
    dm.update({f"model.layers.{i}": first if i < k else second for i in range(num_layers)})
    dm.update({"model.norm": second, "lm_head": second})
    return dm


def place(args, dtype: torch.dtype, work: Path):
    """The random target in ``dtype``, spread over ``args.devices``: (model, seconds to build and place)."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    n = SHAPES[args.shape]["num_hidden_layers"]
    dm = device_map(n, args.devices, args.split)
    build_on = args.devices[0] if args.devices[0].startswith("cuda") else "cpu"
    model = build_target(args.shape, build_on, dtype)
    offload = Path(tempfile.mkdtemp(prefix="offload-", dir=work))  # fresh: accelerate reuses an index.json it finds
    if args.via == "dispatch":
        for name, dev in dm.items():
            if dev == "cpu":  # offloaded weights are kept where they are: put them in host memory first
                model.get_submodule(name).to("cpu")
        model = dispatch_model(model, device_map=dm, main_device=args.devices[0], offload_dir=str(offload),
                               skip_keys=model._skip_keys_device_placement)
    else:
        saved = work / f"target-{str(dtype).removeprefix('torch.')}"
        model.to("cpu").save_pretrained(saved)  # written from host memory, as a downloaded checkpoint would be
        del model
        _free()
        model = AutoModelForCausalLM.from_pretrained(saved, device_map=dm, dtype=dtype, attn_implementation="sdpa",
                                                     offload_folder=str(offload)).eval()
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    sync()
    return model, time.perf_counter() - t0


def placement(model, aux: tuple[int, ...]) -> dict:
    """Where the embeddings, layers and captured states compute, and which modules are offloaded."""
    from eagle_mm.hf.parts import execution_device, resolve_target

    parts = resolve_target(model)
    layers = [str(execution_device(m)) for m in parts.layers]
    offloaded = [i for i, m in enumerate(parts.layers) if any(p.device.type == "meta" for p in m.parameters())]

    def state_device(i: int) -> str:  # hidden_states[i] is the output of layer i-1 (0: the embeddings)
        if i == 0:
            return str(execution_device(parts.embed))
        return layers[i - 1] if i < parts.num_layers + 1 else layers[-1]

    return {"embed": str(execution_device(parts.embed)), "lm_head": str(execution_device(parts.lm_head)),
            "layers": {d: layers.count(d) for d in dict.fromkeys(layers)}, "offloaded_layers": offloaded,
            "aux_layers": list(aux), "aux_state_devices": [state_device(i) for i in aux]}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_dtype(args, dtype: torch.dtype, work: Path) -> dict:
    import eagle_mm as em
    from eagle_mm.hf.parts import execution_device

    logger.info("%s: building and placing the target", dtype)
    model, place_s = place(args, dtype, work)
    logger.info("%s: placed in %.1f s", dtype, place_s)
    placed = {}
    if torch.cuda.is_available():  # weights only, then the peaks of decoding on top of them
        for i in range(torch.cuda.device_count()):
            placed[f"cuda:{i}"] = torch.cuda.memory_allocated(i) / 2**30
            torch.cuda.reset_peak_memory_stats(i)
    n = SHAPES[args.shape]["num_hidden_layers"]
    aux = tuple(args.aux) if args.aux else em.Eagle3Config.default_aux_layers(n)
    dev = execution_device(model.get_input_embeddings())
    ids = torch.randint(3, 8192, (1, args.prompt_len), generator=torch.Generator().manual_seed(1)).to(dev)
    L, new = ids.shape[1], args.new_tokens
    tree = em.TreeConfig(depth=args.tree[0], top_k=args.tree[1], total_tokens=args.tree[2])
    base = em.Eagle3Head.from_target(model, aux_layers=aux)  # on the embeddings' device, in the target's dtype
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up (CUDA context, kernels' first launches)
    em.speculative_generate(model, base, input_ids=ids, max_new_tokens=4, tree=tree)  # warm-up (Triton compile)
    logger.info("%s: warmed up", dtype)

    ref, gen_s = timed_call(lambda: model.generate(ids, max_new_tokens=new, do_sample=False, output_scores=True,
                                               return_dict_in_generate=True))
    top2 = torch.stack([s[0].float() for s in ref.scores]).topk(2, dim=-1).values  # (new, 2)
    gaps = (top2[:, 0] - top2[:, 1]).cpu()
    ref_ids = ref.sequences
    result = {"dtype": str(dtype).removeprefix("torch."), "place_s": round(place_s, 2),
              "placement": placement(model, aux), "prompt_len": L, "new_tokens": new,
              "tree": {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens},
              "generate": {"seconds": gen_s, "tokens_per_s": new / gen_s},
              "reference_min_top2_gap": float(gaps.min()), "reference_ties_below_1e-3": int((gaps < 1e-3).sum())}
    wrong = torch.rand(ref_ids.shape[1], generator=torch.Generator().manual_seed(0)) < 0.2
    heads = {"forced": ForcedHead(base, ref_ids[0], wrong.to(ref_ids.device)), "untrained": base}
    for name, head in heads.items():
        out, s = timed_call(lambda: em.speculative_generate(model, head, input_ids=ids, max_new_tokens=new, tree=tree,
                                                        return_dict_in_generate=True))
        got, want = out.sequences[0, L:].cpu(), ref_ids[0, L:].cpu()
        diff = (got != want).nonzero().flatten() if got.shape == want.shape else torch.tensor([0])
        first = int(diff[0]) if diff.numel() else None
        result[name] = {"identical": first is None, "first_mismatch": first,
                        "top2_gap_at_mismatch": None if first is None else float(gaps[first]),
                        "seconds": s, "tokens_per_s": new / s, "speedup_vs_generate": gen_s / s,
                        "mean_accept_length": out.stats.mean_accept_length,
                        "target_forwards": out.stats.num_target_forwards}
        logger.info("%s %s: identical=%s, %.1f tokens/s (generate %.1f), accept %.2f", result["dtype"], name,
                    first is None, new / s, new / gen_s, out.stats.mean_accept_length)
    if torch.cuda.is_available():
        result["weights_gib"] = placed
        result["peak_memory_gib"] = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2**30
                                     for i in range(torch.cuda.device_count())}
    return result  # the caller frees the model (accelerate's hooks hold it in reference cycles: gc, not refcounts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="--shape tiny --devices cpu disk: a CPU test run")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="target shape (default 8b)")
    p.add_argument("--devices", nargs=2, default=None, metavar=("FIRST", "SECOND"),
                   help="where the first and the second part go: cuda:N, cpu or disk (default cuda:0 cuda:1)")
    p.add_argument("--split", type=float, default=0.5, help="share of the layers on the first device")
    p.add_argument("--via", choices=("dispatch", "pretrained"), default="dispatch")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--aux", type=int, nargs=3, default=None,
                   help="EAGLE-3 hidden_states indices (default 2, N//2, N-3)")
    p.add_argument("--tree", type=int, nargs=3, default=[6, 8, 48], metavar=("DEPTH", "TOP_K", "TOTAL"))
    p.add_argument("--work", default=None, help="scratch folder for offloaded and saved weights (default: a temp dir)")
    p.add_argument("--out", required=True, help="JSON results, rewritten after each dtype")
    args = p.parse_args(argv)
    args.shape = args.shape or ("tiny" if args.tiny else "8b")
    args.devices = args.devices or (["cpu", "disk"] if args.tiny else ["cuda:0", "cuda:1"])
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if any(d.startswith("cuda") for d in args.devices):
        need = max(int(d.partition(":")[2] or 0) for d in args.devices if d.startswith("cuda")) + 1
        if torch.cuda.device_count() < need:
            print(f"--devices {args.devices} needs {need} CUDA GPU(s); {torch.cuda.device_count()} visible",
                  file=sys.stderr)
            return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_split-"))
    work.mkdir(parents=True, exist_ok=True)
    report = {"shape": {args.shape: SHAPES[args.shape]}, "devices": args.devices, "split": args.split,
              "via": args.via, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "accelerate": __import__("accelerate").__version__,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "runs": {}}
    for name in args.dtypes:
        try:
            report["runs"][name] = run_dtype(args, getattr(torch, name), work)
        except Exception as e:  # recorded, then the next dtype runs: one failure must not hide the other result
            logger.exception("%s failed", name)
            report["runs"][name] = {"error": f"{type(e).__name__}: {e}"}
        _free()
        report["ok"] = _ok(report["runs"])
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: {h: r.get(h, {}).get("identical") for h in ("forced", "untrained")} | {"error": r.get("error")}
                      for k, r in report["runs"].items()}))
    return 0 if report["ok"] else 1


# A bf16 mismatch counts as a near-tie when the reference's top-2 logits were this close: a few bf16 rounding
# steps at the logits' magnitude (one step is 1/64 for values in [2, 4), 1/32 in [4, 8)).
NEAR_TIE = 0.125


def _ok(runs: dict) -> bool:
    """float32: identical for both heads; bfloat16: identical, or diverging only at a near-tied reference token."""
    for name, r in runs.items():
        if "error" in r:
            return False
        for h in ("forced", "untrained"):
            if not r[h]["identical"] and (name == "float32" or r[h]["top2_gap_at_mismatch"] > NEAR_TIE):
                return False
    return True


if __name__ == "__main__":
    sys.exit(main())
