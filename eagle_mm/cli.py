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

# Kept tiny so `eagle-mm demo` runs in seconds on a laptop CPU.
_DEMO_VOCAB = 256
_DEMO_HIDDEN = 64
_DEMO_INTERMEDIATE = 128
# Four layers rather than two so an EAGLE-3 head has distinct low, middle and high layers to read.
_DEMO_LAYERS = 4
_DEMO_HEADS = 4
_DEMO_KV_HEADS = 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="speculative decoding on the shipped reference model, checked against generate",
        description=(
            "Complete a Python prompt with the reference model shipped in the package (eagle_mm.zoo "
            "'code-tiny': a small code LM with trained EAGLE-3 and EAGLE heads), decoding greedily with "
            "model.generate and with eagle_mm.speculative_generate; check that the tokens match and print the "
            "acceptance statistics and the speed-up, both timed in this run. Without the shipped model, or with "
            "--random, a tiny random-init Llama and an untrained head stand in (and say so): the tokens still "
            "match, but expect a mean accept length near 1 and no speed-up. With --image, the scenes-tiny reference "
            "VLM describes an image instead."
        ),
    )
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64)
    parser.add_argument("--prompt", default=None, metavar="TEXT",
                        help="Python source to complete (default: the first validation prompt of the build)")
    parser.add_argument("--image", default=None, metavar="PATH",
                        help="describe this image with the scenes-tiny reference VLM (eagle_mm.zoo.scenes_tiny) "
                             "instead")
    parser.add_argument("--device", default=None,
                        help="reference model's device (default: cuda if available, else cpu)")
    parser.add_argument("--random", action="store_true",
                        help="use the tiny random model and an untrained head even when the reference model is "
                             "installed")
    parser.add_argument("--prompt-length", type=_positive_int, default=16, help="random model only: prompt ids")
    parser.add_argument("--seed", type=int, default=0, help="random model only: seeds the weights and the prompt")
    parser.add_argument(
        "--kind", choices=("eagle", "eagle3"), default="eagle3",
        help="draft head: eagle (EAGLE-1/2) or eagle3 (EAGLE-3)",
    )
    tree = parser.add_argument_group("draft tree (defaults: eagle_mm.TreeConfig)")
    tree.add_argument("--depth", type=_positive_int, default=None)
    tree.add_argument("--top-k", type=_positive_int, default=None)
    tree.add_argument("--total-tokens", type=_positive_int, default=None)
    parser.set_defaults(func=_run_demo)


def _tree_kwargs(args: argparse.Namespace) -> dict:
    """Only the tree options the user gave, so TreeConfig stays the one source of defaults."""
    given = {"depth": args.depth, "top_k": args.top_k, "total_tokens": args.total_tokens}
    return {name: value for name, value in given.items() if value is not None}


def _run_demo(args: argparse.Namespace) -> int:
    # Imported here so `eagle-mm --help` stays fast.
    from . import zoo

    if args.image is not None:
        return _run_image_demo(args)
    if not args.random:
        try:
            path = zoo.model_dir("code-tiny")
        except FileNotFoundError as exc:
            print(f"note: no trained reference model: {exc}")
            print("note: using a tiny RANDOM model with an UNTRAINED head instead: it shows that the tokens match "
                  "model.generate, not a speed-up")
        else:
            return _run_zoo_demo(args, path)
    return _run_random_demo(args)


def _run_image_demo(args: argparse.Namespace) -> int:
    if args.random:
        return _fail("--image runs the scenes-tiny reference VLM; drop --random (the random model is text-only)")
    if not Path(args.image).is_file():
        return _fail(f"--image {args.image!r} is not a file; pass the path of a PNG or JPEG image")
    try:
        from .zoo import scenes_tiny
    except ModuleNotFoundError as exc:
        if exc.name != "eagle_mm.zoo.scenes_tiny":
            raise
        return _fail("--image needs the scenes-tiny reference VLM (eagle_mm.zoo.scenes_tiny), which this version of "
                     "eagle_mm lacks; run `eagle-mm demo` without --image for the code model")
    from .config import TreeConfig

    given = _tree_kwargs(args)
    options = {"max_new_tokens": args.max_new_tokens, "device": args.device,
               "tree": TreeConfig(**given) if given else None}
    if args.prompt is not None:
        options["question"] = args.prompt
    try:
        result = scenes_tiny.image_demo(image=args.image, **options)
    except FileNotFoundError as exc:  # the model is not built or not shipped: the message names the build command
        return _fail(str(exc))
    print(f"image: {args.image}\nquestion: {result['question']}\ncompletion: {result['completion']}\n---")
    _print_report(result["identical"], result["mean_accept_length"], result["accept_rate_per_position"],
                  result["generate_s"], result["speculative_s"])
    return 0 if result["identical"] else 1


def _print_report(identical: bool, mean: float, rates, generate_s: float, speculative_s: float, forwards=None) -> None:
    print(f"identical: {identical}")
    print(f"mean accept length: {float(mean):.3f}")
    print(f"accept rate per position: [{', '.join(f'{float(rate):.3f}' for rate in rates)}]")
    if forwards is not None:
        print(f"target forwards: {int(forwards)}")
    print(f"wall time: generate {generate_s:.3f} s, speculative_generate {speculative_s:.3f} s")
    print(f"speed-up: {generate_s / speculative_s:.2f}x (one timed run each)")


def _print_demo_result(reference, out, prompt_length: int, generate_s: float, speculative_s: float) -> bool:
    """The shared part of both demos' report; returns whether the tokens match."""
    new_reference = reference[0, prompt_length:].tolist()
    new_speculative = out.sequences[0, prompt_length:].tolist()
    identical = new_reference == new_speculative
    stats = out.stats
    _print_report(identical, stats.mean_accept_length, stats.accept_rate_per_position, generate_s, speculative_s,
                  forwards=stats.num_target_forwards)
    if not identical:
        first = next(
            (i for i, (a, b) in enumerate(zip(new_reference, new_speculative)) if a != b),
            min(len(new_reference), len(new_speculative)),
        )
        print(
            f"error: speculative_generate differs from model.generate(do_sample=False) at new "
            f"token {first}; greedy speculative decoding must reproduce it token for token",
            file=sys.stderr,
        )
    return identical


def _run_zoo_demo(args: argparse.Namespace, path: Path) -> int:
    import eagle_mm
    from eagle_mm import zoo
    from eagle_mm.benchmark import timed, zoo_prompts

    model = zoo.load_dir(path, device=args.device)
    target, tokenizer = model.target, model.tokenizer
    head = model.eagle3_head if args.kind == "eagle3" else model.eagle_head
    prompt = args.prompt if args.prompt is not None else zoo_prompts(model.prompts, 1)[0]
    enc = tokenizer(prompt, return_tensors="pt").to(target.device)
    prompt_length = enc["input_ids"].shape[1]
    given = _tree_kwargs(args)
    # The model's suggested tree for this device (small on a CPU) unless any tree option was given.
    tree = eagle_mm.TreeConfig(**given) if given else model.demo_tree()
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    # Untimed warm-up of both paths (allocator, kernels, lazy inits), so neither pays it in the timing.
    eagle_mm.speculative_generate(target, head, **enc, **dict(options, max_new_tokens=8), tree=tree)
    target.generate(**enc, **dict(options, max_new_tokens=8))
    reference, generate_s = timed(target.device, lambda: target.generate(**enc, **options))
    out, speculative_s = timed(target.device, lambda: eagle_mm.speculative_generate(
        target, head, **enc, **options, tree=tree, return_dict_in_generate=True))

    info = model.manifest.get("target", {})
    shape = info.get("config", {}).get("shape", {})
    toy = " TOY BUILD (tiny, barely trained)," if model.manifest.get("toy") else ""
    print(f"target: {model.name} from {path} ({shape.get('num_layers')} layers, hidden {shape.get('hidden_size')},"
          f"{toy} validation perplexity {info.get('val_perplexity', float('nan')):.2f}), head: "
          f"{type(head).__name__} (trained), {target.device}, {target.dtype}")
    print(f"tree: depth={tree.depth}, top_k={tree.top_k}, total_tokens={tree.total_tokens}")
    print(f"prompt ({prompt_length} tokens):")
    print(prompt, end="" if prompt.endswith("\n") else "\n")
    print(f"completion ({out.sequences.shape[1] - prompt_length} tokens):")
    print(tokenizer.decode(out.sequences[0, prompt_length:], skip_special_tokens=True))
    print("---")
    return 0 if _print_demo_result(reference, out, prompt_length, generate_s, speculative_s) else 1


def _run_random_demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import eagle_mm
    from eagle_mm.benchmark import timed

    torch.manual_seed(args.seed)
    # No EOS token: every run decodes exactly --max-new-tokens tokens.
    config = LlamaConfig(
        vocab_size=_DEMO_VOCAB,
        hidden_size=_DEMO_HIDDEN,
        intermediate_size=_DEMO_INTERMEDIATE,
        num_hidden_layers=_DEMO_LAYERS,
        num_attention_heads=_DEMO_HEADS,
        num_key_value_heads=_DEMO_KV_HEADS,
        max_position_embeddings=args.prompt_length + args.max_new_tokens + 64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    head_cls = eagle_mm.Eagle3Head if args.kind == "eagle3" else eagle_mm.EagleHead
    head = head_cls.from_target(model)
    input_ids = torch.randint(0, _DEMO_VOCAB, (1, args.prompt_length))  # (B=1, T)

    spec_kwargs = {}
    tree = _tree_kwargs(args)
    if tree:
        spec_kwargs["tree"] = eagle_mm.TreeConfig(**tree)

    reference, generate_s = timed(model.device, lambda: model.generate(
        input_ids, max_new_tokens=args.max_new_tokens, do_sample=False))
    out, speculative_s = timed(model.device, lambda: eagle_mm.speculative_generate(
        model, head, input_ids=input_ids, max_new_tokens=args.max_new_tokens,
        do_sample=False, return_dict_in_generate=True, **spec_kwargs,
    ))

    print(f"target: tiny RANDOM LlamaForCausalLM ({_DEMO_LAYERS} layers, hidden {_DEMO_HIDDEN}), "
          f"head: {head_cls.__name__} (untrained), seed {args.seed}")
    print(f"prompt ids ({args.prompt_length}): {input_ids[0].tolist()}")
    print(f"generate ids ({reference.shape[1] - args.prompt_length}): {reference[0, args.prompt_length:].tolist()}")
    print(f"speculative ids ({out.sequences.shape[1] - args.prompt_length}): "
          f"{out.sequences[0, args.prompt_length:].tolist()}")
    return 0 if _print_demo_result(reference, out, args.prompt_length, generate_s, speculative_s) else 1


# --dtype choices, handed to from_pretrained as they are ("auto": the checkpoint's dtype).
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
    parser.add_argument("--target", required=True, metavar="DIR", help="local target model directory")
    parser.add_argument("--head", required=True, metavar="DIR", help="local draft head directory")
    parser.add_argument("--prompt", required=True, metavar="TEXT")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128)
    parser.add_argument("--dtype", choices=_DTYPES, default="auto",
                        help="target dtype (auto: the checkpoint's); the head follows its checkpoint")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--compare", action="store_true",
                        help="also run model.generate: print the speed-up and whether greedy outputs match")
    sampling = parser.add_argument_group("sampling (default: greedy)")
    sampling.add_argument("--do-sample", action="store_true")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=_positive_int, default=None, help="sampling top-k (not the tree's)")
    sampling.add_argument("--seed", type=int, default=None, help="seeds sampling (generator=)")
    tree = parser.add_argument_group("draft tree (defaults: eagle_mm.TreeConfig)")
    tree.add_argument("--depth", type=_positive_int, default=None)
    tree.add_argument("--top-k-tree", type=_positive_int, default=None, dest="tree_top_k", metavar="TOP_K")
    tree.add_argument("--total-tokens", type=_positive_int, default=None)
    parser.set_defaults(func=_run_generate)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _check_generate_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, before anything heavy is imported or loaded."""
    for flag, path, what in (("--target", args.target, "model"), ("--head", args.head, "draft head")):
        if not Path(path).is_dir():
            return f"no such directory: {path}; pass {flag} a local {what} directory"
    given = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_p", "top_k", "seed")
             if getattr(args, name) is not None]
    if given and not args.do_sample:
        return f"{', '.join(given)}: sampling options, ignored by greedy decoding; add --do-sample"
    return None


def _load_for_generate(args: argparse.Namespace):
    """(model, tokenizer, head) on the chosen device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import eagle_mm

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    # sdpa: flash-attention kernels cannot take the tree mask.
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=args.dtype, attn_implementation="sdpa",
                                                 device_map=device).eval()
    head = eagle_mm.load_head(args.head, target=model)
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

    given = {"depth": args.depth, "top_k": args.tree_top_k, "total_tokens": args.total_tokens}
    try:
        tree = eagle_mm.TreeConfig(**{name: value for name, value in given.items() if value is not None})
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
    n_new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    _print_stats(out.stats, tree, n_new, speculative_s)
    if args.compare:
        _compare(model, inputs, options, args, out.sequences, n_new / speculative_s)
    return 0


def _print_stats(stats, tree, n_new: int, seconds: float) -> None:
    rates = ", ".join(f"{rate:.3f}" for rate in stats.accept_rate_per_position)
    print()
    print(f"tree: depth={tree.depth}, top_k={tree.top_k}, total_tokens={tree.total_tokens}")
    print(f"mean accept length: {stats.mean_accept_length:.3f}")
    print(f"accept rate per position: [{rates}]")
    print(f"target forwards: {stats.num_target_forwards}")
    print(f"speculative_generate: {n_new} tokens in {seconds:.3f} s ({n_new / seconds:.1f} tokens/s)")


def _compare(model, inputs: dict, options: dict, args: argparse.Namespace, sequences, speculative_rate: float) -> None:
    """Time model.generate with the same options; under greedy decoding its tokens must match."""
    import torch

    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    reference = model.generate(**inputs, **options)
    generate_s = time.perf_counter() - start
    n_ref = reference.shape[1] - inputs["input_ids"].shape[1]
    print(f"model.generate: {n_ref} tokens in {generate_s:.3f} s ({n_ref / generate_s:.1f} tokens/s)")
    # Per token: an EOS can end the two runs at different lengths when sampling.
    print(f"speed-up: {speculative_rate / (n_ref / generate_s):.2f}x (one timed run each)")
    if args.do_sample:
        print("greedy outputs match: n/a (sampling: outputs are draws, equal only in distribution)")
        return
    same = reference.shape == sequences.shape and bool(torch.equal(reference, sequences))
    print(f"greedy outputs match: {same}")
    if not same:
        print("warning: greedy speculative decoding should reproduce model.generate token for token; in "
              "bf16/fp16 a near-tie can flip between the tree forward and the step-by-step one "
              "(compare with --dtype float32)", file=sys.stderr)


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    from .export import add_export_parser

    add_export_parser(subparsers)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from .benchmark import add_bench_parser

    add_bench_parser(subparsers)


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    from .train.cli import add_train_parser

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
