"""The `peagle` command line. Each package owns its subcommands in a `cli.py` with `register(subparsers)`."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import sys

# Packages that contribute subcommands, in the order `peagle --help` lists them.
COMMAND_MODULES = [
    "peagle.models.cli",  # convert
    "peagle.drafters.cli",  # drafter, inspect, export
    "peagle.training.cli",  # regenerate, train
    "peagle.server.cli",  # serve
    "peagle.bench.cli",  # bench, testbed, quickstart
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle",
        description="Parallel speculative decoding (P-EAGLE) for Llama/Qwen-family models.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue  # that package has no commands yet
        module.register(sub)
    return parser


def enable_fatal_stacks() -> None:
    """On a fatal signal (a segmentation fault, an abort from a CUDA error in a destructor) print every thread's
    Python stack to stderr before the process dies: a crash in a trainer or an engine otherwise leaves no trace."""
    if not faulthandler.is_enabled():  # an enclosing harness (pytest, python -X faulthandler) may own it already
        faulthandler.enable(all_threads=True)


def main(argv: list[str] | None = None) -> int:
    from peagle.server.cli import expand_config

    enable_fatal_stacks()

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = expand_config(argv)  # serve --config FILE.yaml
    except ValueError as e:
        print(f"peagle serve: error: {e}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"peagle {args.command}: error: {e}", file=sys.stderr)
        return 1
