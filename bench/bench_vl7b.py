"""Qwen2.5-VL-7B-shaped speculative decoding after a 1024-token image, with forced acceptance: tokens/s against
plain decoding's weight-bandwidth ceiling.

Target: a random-init Qwen2.5-VL model in bf16 on CUDA with Qwen2.5-VL-7B-Instruct's language model (28 layers,
3584 wide, 4 KV heads, 152064-token vocabulary, M-RoPE sections 16/24/24; ``shapes.SHAPE_QWEN25VL7B_TEXT``) and a
small vision tower (2 blocks, 256 wide; the real 14-pixel patches, 2x2 merge, 2-frame temporal patches, output
3584 wide). Its embeddings and lm_head are arranged by ``shapes.make_peaked`` (wide greedy margins). Prompt: 8 text
tokens, vision start, one image of grid (1, 64, 64) = 4096 patches = 1024 merged image tokens, vision end, 8 text
tokens. Head: an EAGLE-3 head from the target (one 3584-wide layer, a 32k draft vocabulary; it reads the merged
image embeddings as its layer-0 feature), wrapped in ``forced.ForcedHead`` exactly as bench_8b.py does: each of
our modes first decodes with every proposal wrong, and that output is the mode's forcing reference.
The forced head reads its reference by the head's positions, which are the 1D sequence indices (the prompt's
attention-mask count, image tokens included), not the target's M-RoPE positions: after the image those jump by
the grid's side (32), not by its 1024 tokens. The measured acceptance in each row is the check.

Modes, in run order (bench_8b.py's run_ours / run_generate; --modes picks):
  ceiling            copy bandwidth / the bytes of the weights one decode step reads: the language model (its
                     embedding table included, as bench_8b counts it) and the lm_head; the vision tower, run once at
                     the prefill, is not counted
  generate_eager     model.generate(do_sample=False), dynamic cache (always run: the tokens every row must equal)
  ours_default       speculative_generate(...), the default call
  ours_compiled      speculative_generate(compile=True)
  generate_compiled  model.generate(cache_implementation="static"): HF compiles the decode step on CUDA
Rows report tokens/s end to end and decode tokens/s (the prefill, image encoding included, excluded), then a
final line says whether the issue's target is met: decode tokens/s of ours_default and ours_compiled >= 2x the
ceiling. Results go to --out after every measurement; a failing mode is recorded and the next one runs.

    PYTHONPATH=. python bench/bench_vl7b.py --out vl7b.json        # the H200 run: ~20 GB of GPU memory, minutes
    PYTHONPATH=. python bench/bench_vl7b.py --tiny --out tiny.json # a tiny Qwen2.5-VL on CPU (fp32), seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_8b import Results, compile_mode, fit_draft_vocab, log, run_generate, run_ours, summarize  # noqa: E402
from forced import ForcedHead, min_depth  # noqa: E402

MODES = ("ceiling", "generate_eager", "ours_default", "ours_compiled", "generate_compiled")
TARGET_X_CEILING = 2.0  # the target: decode tokens/s >= 2x the weight-bandwidth ceiling
# --tiny: a Qwen2.5-VL small enough for the CPU (the shapes of tests/test_multimodal_tiny.py); image grid (1, 8, 8).
TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3]))
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
TINY_TOKENS = dict(image_token_id=511, video_token_id=510, vision_start_token_id=509, vision_end_token_id=508)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen2.5-VL on CPU (fp32), image grid (1, 8, 8)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--accept", type=float, nargs="+", default=[4], help="forced mean tokens per cycle")
    p.add_argument("--grid", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                   help="the image's patch grid (default 1 64 64: 1024 image tokens; --tiny: 1 8 8)")
    p.add_argument("--text-len", type=int, default=8, help="text tokens before and after the image, each")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=32, help="tree nodes verified per cycle (root excluded)")
    p.add_argument("--chain", action="store_true", help="draft a chain of --depth tokens instead of a tree")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile mode of ours_compiled on CUDA")
    p.add_argument("--cpu-compile-mode", default="none",
                   help="torch.compile mode of ours_compiled on CPU (--tiny): 'none' (the default) runs the engine "
                        "uncompiled, in seconds; 'default' compiles it with inductor (about 80 s here)")
    p.add_argument("--profile", action="store_true",
                   help="profile one decode per mode of ours at the first --accept level (a text file beside --out)")
    p.add_argument("--out", default=None, help="JSON results, rewritten after every measurement")
    return p.parse_args(argv)


def build(args, device):
    """(target, EAGLE-3 head) on ``device``: bf16 on CUDA, built in bf16 (nothing in fp32 on the GPU); fp32 --tiny."""
    import eagle_mm
    from shapes import (QWEN25VL_TOKENS, SHAPE_QWEN25VL7B_TEXT, SHAPE_QWEN25VL_SMALL_VISION, make_peaked,
                        random_qwen25vl_target)

    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = (TINY_TEXT, TINY_VISION, TINY_TOKENS) if args.tiny else (
        SHAPE_QWEN25VL7B_TEXT, SHAPE_QWEN25VL_SMALL_VISION, QWEN25VL_TOKENS)
    target = random_qwen25vl_target(*shape, device=device.type, dtype=dtype)
    make_peaked(target)  # greedy far from ties: bf16 rounding cannot derail the forcing
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    vocab = target.config.get_text_config().vocab_size
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # from_target casts to the target's dtype; build it in that dtype already
    try:
        with torch.device(device):
            head = eagle_mm.Eagle3Head.from_target(target, draft_vocab_size=min(args.draft_vocab, vocab // 2))
    finally:
        torch.set_default_dtype(default)
    return target, head.eval().requires_grad_(False)


def image_prompt(target, grid: tuple[int, int, int], text_len: int, device) -> dict:
    """generate()'s inputs for one row: text, vision start, the image's placeholders, vision end, text; random
    pixels of the shape the vision tower takes, (T*H*W patches, 3 * temporal_patch * patch^2), in its dtype."""
    cfg, vision = target.config, target.config.vision_config
    n_image = grid[0] * grid[1] * grid[2] // vision.spatial_merge_size ** 2
    g = torch.Generator().manual_seed(0)
    special = min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    text = torch.randint(3, special, (2, text_len), generator=g)
    ids = torch.cat((text[0], torch.tensor([cfg.vision_start_token_id]), torch.full((n_image,), cfg.image_token_id),
                     torch.tensor([cfg.vision_end_token_id]), text[1]))[None]  # (1, T)
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.randn(grid[0] * grid[1] * grid[2], patch, generator=g)
    return dict(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                mm_token_type_ids=(ids == cfg.image_token_id).int().to(device),
                pixel_values=pixels.to(device, target.dtype), image_grid_thw=torch.tensor([grid]).to(device))


def ceiling_row(target) -> dict:
    """Plain decoding's bound: measured copy bandwidth / the bytes of the weights a decode step reads."""
    from harness import copy_bandwidth

    vision = {id(p) for p in target.model.visual.parameters()}
    params = [p for p in target.parameters() if id(p) not in vision]
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    vision_bytes = sum(p.numel() * p.element_size() for p in target.model.visual.parameters())
    bw = copy_bandwidth()
    return {"mode": "ceiling", "tokens_per_s": bw / weight_bytes, "copy_bandwidth_GBps": bw / 1e9,
            "weight_GB": weight_bytes / 1e9, "vision_GB_not_counted": vision_bytes / 1e9,
            "weights": "language model + lm_head; not the vision tower (it runs once, at the prefill)"}


def verdict(rows, accept: list[float]) -> list[str]:
    """One line per forced level: met or missed for ours_default and ours_compiled (decode >= 2x the ceiling)."""
    ceiling = next((r["tokens_per_s"] for r in rows if r["mode"] == "ceiling"), None)
    lines = []
    for tau in accept:
        parts = []
        for mode in ("ours_default", "ours_compiled"):
            row = next((r for r in rows if r["mode"] == mode and r.get("accept") == tau), None)
            dec = row and row.get("decode_tokens_per_s")
            if dec is None:
                parts.append(f"{mode} not measured")
            elif ceiling is None:
                parts.append(f"{mode} {dec:.1f} decode tokens/s")
            else:
                x = dec / ceiling
                parts.append(f"{mode} {'MET' if x >= TARGET_X_CEILING else 'MISSED'} ({dec:.1f} decode tokens/s = "
                             f"{x:.2f}x the ceiling)")
        bound = f"the {ceiling:.1f} tokens/s ceiling" if ceiling else "the ceiling, not measured (CUDA only)"
        lines.append(f"target (decode >= {TARGET_X_CEILING:g}x {bound}) at forced accept {tau:g}: " + "; ".join(parts))
    return lines


def main(argv=None) -> dict:
    args = parse_args(argv)
    import eagle_mm
    import transformers

    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_vl7b.py needs a CUDA GPU (or --tiny for the CPU smoke run)")
    grid = tuple(args.grid or ((1, 8, 8) if args.tiny else (1, 64, 64)))
    if args.tiny:
        args.new_tokens = min(args.new_tokens, 32)
    depth = max(args.depth, min_depth(max(args.accept)))
    tree = (eagle_mm.TreeConfig.chain(depth) if args.chain
            else eagle_mm.TreeConfig(depth=depth, top_k=args.top_k, total_tokens=args.total_tokens))
    log(f"building the {'tiny' if args.tiny else 'Qwen2.5-VL-7B-shaped'} target and head on {device}")
    target, head = build(args, device)
    inputs = image_prompt(target, grid, args.text_len, device)
    ids = inputs.pop("input_ids")
    tc = target.config.get_text_config()
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "tiny": args.tiny, "layers": tc.num_hidden_layers, "hidden": tc.hidden_size, "dtype": str(target.dtype),
            "draft_vocab": head.config.draft_vocab_size, "tree": dataclasses.asdict(tree), "image_grid": list(grid),
            "image_tokens": int((ids == target.config.image_token_id).sum()), "prompt_len": ids.shape[1],
            "new_tokens": args.new_tokens, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "eagle_mm": eagle_mm.__version__}
    results = Results(args.out, meta)
    if "ceiling" in args.modes:
        if device.type == "cuda":
            results.add(ceiling_row(target))
        else:
            log("ceiling: skipped, the copy bandwidth is measured on CUDA only")
    # generate eager always runs: its tokens are the reference and the forcing's first draft vocabulary.
    gen_ref = run_generate("generate_eager", target, ids, args, device, results, inputs=inputs)
    reference = torch.cat((gen_ref.cpu(), gen_ref.new_zeros(1, depth + 4).cpu()), 1)
    forced = ForcedHead(head, reference.to(device), draft_index=fit_draft_vocab(head, gen_ref))
    for mode in [m for m in MODES if m in args.modes and m not in ("ceiling", "generate_eager")]:
        try:  # one failing mode (a compile error, say) must not cost the others their figures
            if mode.startswith("ours"):
                if mode == "ours_compiled" and device.type != "cuda":
                    log(f"ours_compiled: on CPU torch.compile mode {compile_mode(args, device)} (no CUDA graphs)")
                run_ours(mode, target, forced, ids, args, tree, device, gen_ref, results, inputs=inputs)
            else:
                if device.type != "cuda":
                    log("generate_compiled: on CPU generate() does not compile; timing its static cache only")
                run_generate(mode, target, ids, args, device, results, gen_ref, inputs=inputs)
        except Exception as e:  # noqa: BLE001 - reported in the results, then the next mode runs
            import traceback

            traceback.print_exc()
            results.add({"mode": mode, "error": f"{type(e).__name__}: {e}"[:2000]})
    summarize(results.data["rows"])
    results.data["verdict"] = verdict(results.data["rows"], args.accept)
    results.save()
    print("\n" + "\n".join(results.data["verdict"]))
    log("done")
    return results.data


if __name__ == "__main__":
    main(sys.argv[1:])
