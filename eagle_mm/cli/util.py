"""Argument types, argument checks and error reporting shared by the `eagle-mm` subcommands."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["positive_int", "fail", "check_model_dir", "check_prompt", "quiet_loading"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def fail(message: str) -> int:
    """Print ``error: message`` to stderr; the exit status of a usage error."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def check_model_dir(path: str, flag: str = "--target") -> str | None:
    """The problem with ``path`` as a local Hugging Face model directory, or None.

    A reference model's root (``eagle_mm.zoo``: it holds ``target/`` and the heads beside it) is named as such,
    with the directory to pass instead, rather than left to fail deep inside ``from_pretrained``.
    """
    root = Path(path)
    if not root.is_dir():
        return f"no such directory: {path}; pass {flag} a local model directory (what save_pretrained writes)"
    if (root / "config.json").is_file():
        return None
    if (root / "target" / "config.json").is_file():
        return (f"{path} is a reference model's folder, not a model: the target is in its target/ subfolder; "
                f"pass {flag} {root / 'target'}")
    return f"{path} has no config.json; pass {flag} a Hugging Face model directory (what save_pretrained writes)"


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
