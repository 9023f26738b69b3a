"""The `eagle-mm` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`func` to a `_run_<name>(args) -> int` handler; `main` dispatches to it. To add a subcommand,
write that pair and list the `_add_` function in `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .util import add_tree_args, check_model_dir, check_prompt, quiet_loading, tree_kwargs
from .util import fail as _fail
from .util import positive_int as _positive_int
from .demo import add_demo_parser as _add_demo
from .demo import print_forwards


# --dtype choices. "auto": float32 on a CPU (bf16 matmuls are slow there, and its rounding flips near-ties), the
# checkpoint's dtype on a GPU.
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a completion from a local target model with a draft head",
        description=(
            "Load a local Hugging Face causal LM (--target) and a draft head (--head: saved with "
            "save_pretrained, or an official EAGLE/EAGLE-3 release), stream the completion of --prompt "
            "decoded with eagle_mm.speculative_generate, and print acceptance statistics. --compare also "
            "runs model.generate with the same options and prints the speed-up."
        ),
    )
    parser.add_argument("--target", required=True, metavar="DIR", help="local target model directory or .gguf file")
    parser.add_argument("--head", required=True, metavar="DIR", help="local draft head directory")
    parser.add_argument("--prompt", required=True, metavar="TEXT")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128)
    parser.add_argument("--dtype", choices=_DTYPES, default="auto",
                        help="dtype of the target and the head (auto: float32 on a CPU, the checkpoint's on a GPU)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--compare", action="store_true",
                        help="also run model.generate: print the speed-up and whether the greedy outputs are "
                             "identical (or differ only at a numerical near-tie)")
    parser.add_argument("--verbose", action="store_true", help="show transformers' loading progress bars")
    sampling = parser.add_argument_group("sampling (default: greedy)")
    sampling.add_argument("--do-sample", action="store_true")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=_positive_int, default=None, help="sampling top-k (not the tree's)")
    sampling.add_argument("--seed", type=int, default=None, help="seeds sampling (generator=)")
    add_tree_args(parser, "draft tree (default: the tree speculative_generate's default call drafts)",
                  top_k_flag="--top-k-tree")
    parser.set_defaults(func=_run_generate)


def _check_generate_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, before anything heavy is imported or loaded."""
    problem = check_model_dir(args.target, "--target") or check_prompt(args.prompt)
    if problem:
        return problem
    if not Path(args.head).is_dir():
        return f"no such directory: {args.head}; pass --head a local draft head directory"
    given = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_p", "top_k", "seed")
             if getattr(args, name) is not None]
    if given and not args.do_sample:
        return f"{', '.join(given)}: sampling options, ignored by greedy decoding; add --do-sample"
    if args.temperature is not None and args.temperature <= 0:
        return (f"--temperature {args.temperature:g}: sampling divides the logits by it, so it must be > 0; for "
                f"greedy decoding drop --do-sample")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        return f"--top-p {args.top_p:g}: a probability mass, it must be in (0, 1] (1 keeps every token)"
    return None


def _load_for_generate(args: argparse.Namespace):
    """(model, tokenizer, head) on the chosen device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import eagle_mm
    from ..hf.gguf import model_source

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype
    if dtype == "auto" and device.type == "cpu":
        dtype = "float32"
    source = model_source(args.target)  # a GGUF file's converted folder
    tokenizer = AutoTokenizer.from_pretrained(source)
    # sdpa: flash-attention kernels cannot take the tree mask.
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa",
                                                 device_map=device).eval()
    head = eagle_mm.load_head(args.head, target=model, dtype=model.dtype)
    return model, tokenizer, head


def _encode(tokenizer, args: argparse.Namespace, device) -> dict:
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tokenizer(args.prompt, return_tensors="pt")
    # Only what every causal LM takes: some tokenizers add token_type_ids, which generate() would pass on.
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def _run_generate(args: argparse.Namespace) -> int:
    problem = _check_generate_args(args)
    if problem:
        return _fail(problem)
    import torch
    from transformers import TextStreamer

    import eagle_mm

    quiet_loading(args.verbose)
    given = tree_kwargs(args)
    try:
        # No tree options: None, so the call drafts what the default call drafts on this device.
        tree = eagle_mm.TreeConfig(**given) if given else None
        model, tokenizer, head = _load_for_generate(args)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    if args.chat and not getattr(tokenizer, "chat_template", None):
        return _fail(f"the tokenizer in {args.target} has no chat_template; drop --chat to send the prompt as is")
    inputs = _encode(tokenizer, args, model.device)
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    options.update({name: getattr(args, name) for name in ("temperature", "top_p", "top_k")
                    if getattr(args, name) is not None})

    def generator():
        return None if args.seed is None else torch.Generator(device=model.device).manual_seed(args.seed)

    try:
        if args.compare:
            # Untimed warm-up of both paths (allocator, kernels, lazy inits), so neither pays it in the timing.
            warm = dict(options, max_new_tokens=min(8, args.max_new_tokens))
            eagle_mm.speculative_generate(model, head, **inputs, **warm, tree=tree, generator=generator())
            model.generate(**inputs, **warm)
        start = time.perf_counter()
        out = eagle_mm.speculative_generate(
            model, head, **inputs, **options, tree=tree, generator=generator(), return_dict_in_generate=True,
            streamer=TextStreamer(tokenizer, skip_prompt=True),
        )
        speculative_s = time.perf_counter() - start
    except ValueError as exc:  # an option generate() or the loop refuses: its message, on one line
        return _fail(" ".join(str(exc).split()))
    n_new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    _print_stats(out.stats, n_new, speculative_s)
    print(f"dtype: target {model.dtype}, head {next(head.parameters()).dtype}; device: {model.device}")
    if args.compare:
        return _compare(model, inputs, options, args, out.sequences, n_new / speculative_s)
    return 0


def _print_stats(stats, n_new: int, seconds: float) -> None:
    rates = ", ".join(f"{rate:.3f}" for rate in stats.accept_rate_per_position)
    tree = stats.tree
    print()
    print(f"tree: depth={tree.depth}, top_k={tree.top_k}, total_tokens={tree.total_tokens}")
    print(f"mean accept length: {stats.mean_accept_length:.3f} (tokens per target forward; plain decoding: 1)")
    print(f"accept rate per position: [{rates}] (entry i: the share of forwards that kept the first i+1 drafts)")
    print_forwards(stats, n_new)
    print(f"speculative_generate: {n_new} tokens in {seconds:.3f} s ({n_new / seconds:.1f} tokens/s)")


def _compare(model, inputs: dict, options: dict, args: argparse.Namespace, sequences, speculative_rate: float) -> int:
    """Time model.generate with the same options; under greedy decoding its tokens must match (the exit status:
    1 on a mismatch that rounding does not explain)."""
    import torch

    from ..divergence import compare_greedy

    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    reference = model.generate(**inputs, **options)
    generate_s = time.perf_counter() - start
    n_ref = reference.shape[1] - inputs["input_ids"].shape[1]
    print(f"model.generate: {n_ref} tokens in {generate_s:.3f} s ({n_ref / generate_s:.1f} tokens/s)")
    # Per token: an EOS can end the two runs at different lengths when sampling.
    print(f"speed-up: {speculative_rate / (n_ref / generate_s):.2f}x (one timed run each; eagle-mm bench times several "
          f"and reports their median)")
    if args.do_sample:
        print("greedy outputs: n/a (sampling: outputs are draws, equal only in distribution)")
        return 0
    verdict = compare_greedy(model, reference, sequences, inputs["input_ids"].shape[1])
    print(f"greedy outputs: {verdict}")
    return 1 if verdict.is_mismatch else 0


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    from .export import add_export_parser

    add_export_parser(subparsers)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from .bench import add_bench_parser

    add_bench_parser(subparsers)


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    from .train import add_train_parser

    add_train_parser(subparsers)


_SUBCOMMANDS = (_add_demo, _add_generate, _add_train, _add_bench, _add_export)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle-mm",
        description="EAGLE speculative-decoding draft heads for Hugging Face models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `eagle-mm` with `argv` (default: sys.argv[1:]); returns the exit status."""
    args = _build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
