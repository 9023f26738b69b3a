"""Argument types, argument checks and error reporting shared by the `eagle-mm` subcommands."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["positive_int", "fail", "check_model_dir", "check_prompt", "quiet_loading", "add_tree_args",
           "tree_kwargs"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_tree_args(parser: argparse.ArgumentParser, title: str, *, top_k_flag: str = "--top-k",
                  kind=positive_int) -> None:
    """The draft tree's options (--depth, --top-k, --total-tokens), all None unless given: TreeConfig stays the one
    source of their defaults. ``top_k_flag``: another name where --top-k means something else (its dest is then
    ``tree_top_k``)."""
    group = parser.add_argument_group(title)
    group.add_argument("--depth", type=kind, default=None)
    if top_k_flag == "--top-k":
        group.add_argument("--top-k", type=kind, default=None)
    else:
        group.add_argument(top_k_flag, type=kind, default=None, dest="tree_top_k", metavar="TOP_K")
    group.add_argument("--total-tokens", type=kind, default=None)


def tree_kwargs(args: argparse.Namespace) -> dict:
    """The tree options ``add_tree_args`` declared that the user gave, as TreeConfig keyword arguments."""
    top_k = args.tree_top_k if hasattr(args, "tree_top_k") else args.top_k
    given = {"depth": args.depth, "top_k": top_k, "total_tokens": args.total_tokens}
    return {name: value for name, value in given.items() if value is not None}


def fail(message: str) -> int:
    """Print ``error: message`` to stderr; the exit status of a usage error."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def check_model_dir(path: str, flag: str = "--target", head_flag: str = "--head") -> str | None:
    """The problem with ``path`` as a local Hugging Face model directory or GGUF file, or None.

    A reference model's root (``eagle_mm.zoo``: it holds ``target/`` and the heads beside it) is named as such,
    with the directory to pass instead, rather than left to fail deep inside ``from_pretrained``; so is a draft
    head's directory, with the flag that takes it (``head_flag``). A ``.gguf`` file needs the gguf package: its
    absence is named here, with the install command.
    """
    from ..hf.gguf import gguf_problem, is_gguf

    if is_gguf(path):
        return gguf_problem(path, flag)
    root = Path(path)
    if not root.is_dir():
        return (f"no such directory: {path}; pass {flag} a local model directory (what save_pretrained writes) "
                f"or a .gguf file")
    if (root / "config.json").is_file():
        if _is_draft_head(root / "config.json"):
            return (f"{path} is a draft head, not a target: pass it with {head_flag}, and the model it drafts for "
                    f"with {flag}")
        return None
    if (root / "target" / "config.json").is_file():
        return (f"{path} is a reference model's folder, not a model: the target is in its target/ subfolder; "
                f"pass {flag} {root / 'target'}")
    return f"{path} has no config.json; pass {flag} a Hugging Face model directory (what save_pretrained writes)"


def _is_draft_head(config_file: Path) -> bool:
    """Whether a config.json is a draft head's, by what heads' configs hold and targets' never do: an EAGLE
    architecture, a draft vocabulary, EAGLE-3's aux layer ids, a speculators section, or an EAGLE-1 head's one
    layer with its fc ``bias`` flag."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # loading it says what is wrong
    if not isinstance(config, dict):
        return False
    archs = [str(a).lower() for a in config.get("architectures") or []]
    return (any("eagle" in a for a in archs) or "draft_vocab_size" in config or "eagle_config" in config
            or "speculators_config" in config or ("bias" in config and config.get("num_hidden_layers") == 1))


def check_prompt(prompt: str, flag: str = "--prompt") -> str | None:
    """The problem with a prompt given on the command line, or None: decoding needs at least one token."""
    if not prompt:
        return f"{flag} {prompt!r} is empty; pass the text to complete"
    return None


def quiet_loading(verbose: bool) -> None:
    """transformers' loading progress bars on only with --verbose: on every command they are noise."""
    from transformers.utils import logging as hf_logging

    if verbose:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
