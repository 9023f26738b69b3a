"""`eagle-mm export`: write a draft head in the layout an engine loads and print the command that serves it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import TreeConfig
from ..heads.base import layout_names
from ..heads.engines import export_head, export_notes, serving_command
from ..heads.io import load_head
from .util import add_tree_args, check_model_dir, tree_kwargs

__all__ = ["add_export_parser", "run_export"]

def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare `eagle-mm export`; its handler is ``run_export``."""
    parser = subparsers.add_parser(
        "export",
        help="write a draft head in the eagle, vllm, sglang or speculators layout, and print the serve command",
        description="Load HEAD_DIR (ours or an official EAGLE head), write it to OUTPUT in --layout, print how to serve it.",
    )
    parser.add_argument("head_dir", metavar="HEAD_DIR", help="a head saved by save_pretrained or an official EAGLE release")
    parser.add_argument("--layout", required=True, choices=layout_names(),
                        help="eagle (official), vllm, sglang or speculators (docs/serving.md tables them)")
    parser.add_argument("--output", required=True, metavar="OUT_DIR", help="directory to write (created if missing)")
    parser.add_argument("--target", metavar="TARGET_DIR",
                        help="local target model directory or .gguf file: checks sizes and aux layers, named in the "
                             "command")
    parser.add_argument("--engine-version", metavar="VERSION",
                        help="the vLLM (vllm, speculators layouts) or SGLang (sglang layout) release you serve with, "
                             "e.g. 0.17.1: refuses aux layers it cannot capture (default: the newest conventions)")
    add_tree_args(parser, "draft tree in the command (defaults: eagle_mm.TreeConfig)", kind=int)
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Handler of `eagle-mm export`; returns the exit status."""
    head_dir, out = Path(args.head_dir), Path(args.output)
    if not head_dir.is_dir():
        return _fail(f"head directory {str(head_dir)!r} does not exist; pass a directory written by "
                     f"save_pretrained or a downloaded EAGLE head")
    if out.resolve() == head_dir.resolve():
        return _fail("--output must differ from HEAD_DIR: exporting in place would overwrite the source head")
    problem = None if args.target is None else check_model_dir(args.target, "--target")
    if problem:
        return _fail(problem)
    try:
        tree = TreeConfig(**tree_kwargs(args))
        target_config = None
        if args.target is not None:
            from transformers import AutoConfig  # here, so `eagle-mm --help` stays fast

            from ..hf.gguf import model_source

            target_config = AutoConfig.from_pretrained(model_source(args.target), local_files_only=True)
        head = load_head(head_dir)
        export_head(head, out, args.layout, target_config=target_config, engine_version=args.engine_version)
        print(f"wrote {type(head).__name__} in the {args.layout} layout to {out}")
        for note in export_notes(head, args.layout, target_config=target_config, engine_version=args.engine_version):
            print(f"note: {note}")
        if args.layout == "eagle":
            print("serve it with the official EAGLE code, or export with --layout vllm / sglang for an engine")
        else:
            print(serving_command(out, args.layout, target_path=args.target or "TARGET", tree=tree))
    except (ValueError, OSError) as e:
        return _fail(str(e), status=1)
    return 0


def _fail(message: str, status: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status
