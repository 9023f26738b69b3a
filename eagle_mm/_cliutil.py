"""Argument types and error reporting shared by the `eagle-mm` subcommands."""
from __future__ import annotations

import argparse
import sys

__all__ = ["positive_int", "fail"]


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
