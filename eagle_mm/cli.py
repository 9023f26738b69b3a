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
        help="speculative vs plain greedy decoding on a tiny random model",
        description=(
            "Build a tiny random-init Llama and an untrained draft head, decode greedily with "
            "model.generate and with eagle_mm.speculative_generate, and check the tokens match. "
            "An untrained head is rarely right, so expect a mean accept length near 1."
        ),
    )
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32)
    parser.add_argument("--prompt-length", type=_positive_int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompt")
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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import eagle_mm

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

    start = time.perf_counter()
    reference = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    generate_s = time.perf_counter() - start

    start = time.perf_counter()
    out = eagle_mm.speculative_generate(
        model, head, input_ids=input_ids, max_new_tokens=args.max_new_tokens,
        do_sample=False, return_dict_in_generate=True, **spec_kwargs,
    )
    speculative_s = time.perf_counter() - start

    new_reference = reference[0, args.prompt_length:].tolist()
    new_speculative = out.sequences[0, args.prompt_length:].tolist()
    identical = new_reference == new_speculative
    stats = out.stats
    rates = ", ".join(f"{float(rate):.3f}" for rate in stats.accept_rate_per_position)

    print(f"target: tiny random LlamaForCausalLM ({_DEMO_LAYERS} layers, hidden {_DEMO_HIDDEN}), "
          f"head: {head_cls.__name__} (untrained), seed {args.seed}")
    print(f"prompt ids ({args.prompt_length}): {input_ids[0].tolist()}")
    print(f"generate ids ({len(new_reference)}): {new_reference}")
    print(f"speculative ids ({len(new_speculative)}): {new_speculative}")
    print(f"identical: {identical}")
    print(f"mean accept length: {float(stats.mean_accept_length):.3f}")
    print(f"accept rate per position: [{rates}]")
    print(f"target forwards: {int(stats.num_target_forwards)}")
    print(f"wall time: generate {generate_s:.3f} s, speculative_generate {speculative_s:.3f} s")
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
        return 1
    return 0


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    from .export import add_export_parser

    add_export_parser(subparsers)


_SUBCOMMANDS = (_add_demo, _add_export)


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
