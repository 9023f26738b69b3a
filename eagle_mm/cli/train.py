"""`eagle-mm train` / `python -m eagle_mm.train` / `accelerate launch -m eagle_mm.train`.

Every option is generated from a ``TrainConfig`` field (``--max-length`` for ``max_length``), with the field's
help text and default, so the dataclass stays the one source of defaults. ``--config FILE.json`` reads a saved
``train_config.json``; options given on the command line override it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path

from ..train.config import TrainConfig
from .util import check_model_dir, quiet_loading

__all__ = ["add_train_parser", "add_train_arguments", "run_train", "main"]

# Short spellings the docs use; the long generated names work too.
_ALIASES = {"output_dir": ["--output"], "features_dir": ["--features"]}
_DESCRIPTION = (
    "Train an EAGLE-3 (default) or EAGLE-1 draft head for a Hugging Face target on JSON-lines data, with the "
    "target's features computed online or read from a --dump-features directory. Runs on one process or "
    "many (accelerate launch -m eagle_mm.train ...). The output directory is a head that "
    "EagleHead/Eagle3Head.from_pretrained loads."
)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to an ``eagle-mm`` subparsers object; it dispatches to ``run_train``."""
    parser = subparsers.add_parser("train", help="train a draft head", description=_DESCRIPTION)
    add_train_arguments(parser)
    parser.set_defaults(func=run_train)
    return parser


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a train_config.json whose fields are the defaults of this run")
    parser.add_argument("--dump-features", metavar="DIR", default=None,
                        help="run the target once over --data and write its features to DIR (then train with "
                             "--features DIR), instead of training")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in an output directory that holds an earlier run: delete its checkpoints "
                             "and logs first (without it such a directory is refused; --resume continues it)")
    parser.add_argument("--verbose", action="store_true", help="show transformers' loading progress bars")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + _ALIASES.get(f.name, [])
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "") + ("" if default is None else f" (default: {default})")
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text, **_arg_kind(hints[f.name]))
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if f.name == "resume":
            kw.update(nargs="?", const="auto", metavar="CHECKPOINT")
        parser.add_argument(*names, **kw)


def _arg_kind(hint) -> dict:
    """argparse keywords for a field's type: bools get --x/--no-x, tuples take several values."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is tuple:
        item = args[0]
        return {"type": item, "nargs": "+" if Ellipsis in args else len(args), "metavar": item.__name__.upper()}
    return {"type": hint}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {}
    if args.config is not None:
        with open(args.config, encoding="utf-8") as f:
            values = json.load(f)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values.update({k: v for k, v in vars(args).items() if k in names})
    if args.dump_features is not None:
        values.setdefault("output_dir", args.dump_features)  # dumping writes nowhere else
    missing = [n for n in ("target", "output_dir") if n not in values]
    if missing:
        raise ValueError(f"missing required option(s): {', '.join('--' + m.replace('_', '-') for m in missing)}")
    problem = check_model_dir(values["target"], "--target", "--init-head")
    if problem:
        raise ValueError(problem)
    out = values["output_dir"]
    if os.path.exists(out) and not os.path.isdir(out):
        flag = "--dump-features" if args.dump_features is not None else "--output-dir"
        raise ValueError(f"{flag} {str(out)!r} is an existing file; it must be a directory (created if missing): "
                         f"choose another path or remove the file")
    return TrainConfig.from_dict(values)


def _clear_earlier_run(config: TrainConfig) -> None:
    """--overwrite: remove what an earlier run left in output_dir (checkpoints, logs, cached rows); the head's
    own files are rewritten at the end of this one."""
    from ..train.checkpoint import CHECKPOINTS
    from ..train.loop import EVAL_NAME, LOG_NAME, REGENERATED_NAME

    if config.resume is not None:
        raise ValueError(f"--overwrite starts afresh, --resume {config.resume} continues: pass one of them")
    out = Path(config.output_dir)
    if (out / CHECKPOINTS).is_dir():
        logging.getLogger(__name__).info("--overwrite: removing %s", out / CHECKPOINTS)
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)  # under accelerate every process clears, at once
    for name in (EVAL_NAME, LOG_NAME, REGENERATED_NAME):
        (out / name).unlink(missing_ok=True)


def _setup_logging() -> None:
    if logging.getLogger().handlers:
        return
    main_process = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.INFO if main_process else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_train(args: argparse.Namespace) -> int:
    """Handler of ``eagle-mm train``: returns the exit status (2 for bad options or data)."""
    _setup_logging()
    quiet_loading(args.verbose)
    try:
        config = config_from_args(args)
        if args.overwrite and args.dump_features is None:
            _clear_earlier_run(config)
        if args.dump_features is not None:
            from ..train.dump import dump_features

            dump_features(config, args.dump_features)
            return 0
        from ..train.loop import train

        result = train(config)
    except (ValueError, OSError) as e:  # bad options or data, a missing file, a full disk: one line
        print(f"eagle-mm train: error: {e}", file=sys.stderr)
        return 2
    if result.mean_accept_length is not None:
        logging.getLogger(__name__).info("mean acceptance length: %.3f", result.mean_accept_length)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_mm.train", description=_DESCRIPTION)
    add_train_arguments(parser)
    return run_train(parser.parse_args(argv))
