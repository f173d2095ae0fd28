"""The argparse pieces the tools share (tools/ parse arguments and call the library; run_cli is in errors)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from passes.errors import UserError


def tool_parser(prog: str, description: str | None, epilog: str | None = None) -> argparse.ArgumentParser:
    """A tool's parser: its module docstring above the options, the examples below them, as written."""
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_token_source(parser: argparse.ArgumentParser, purpose: str, text_first: bool = False) -> None:
    """--text FILE... or --tokens IDS.npy (one of them), for `purpose` ("calibration", "evaluation")."""
    source = parser.add_mutually_exclusive_group()
    options = {
        "--tokens": {"type": Path, "metavar": "IDS.npy", "help": f"{purpose} token ids (.npy)"},
        "--text": {"type": Path, "nargs": "+", "metavar": "FILE", "help": f"{purpose} text file(s)"},
    }
    add_options(source, reversed(options.items()) if text_first else options.items())


def add_options(parser: Any, options: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
    """add_argument(flag, **settings) for each (flag, settings), in order (a parser or an argument group)."""
    for flag, settings in options:
        parser.add_argument(flag, **settings)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None, *at_least_one: str) -> argparse.Namespace:
    """parser.parse_args(argv); parser.error (exit 2) when an integer option of `at_least_one` is below 1."""
    args = parser.parse_args(argv)
    for name in at_least_one:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def add_data_file_size(parser: argparse.ArgumentParser, output: str = "OUTPUT") -> None:
    """--max-data-file-gb GB: external data in numbered files of at most GB each (passes/io/data_files.py)."""
    parser.add_argument(
        "--max-data-file-gb",
        type=float,
        default=0,
        metavar="GB",
        help="external data in numbered files of at most GB each, written at once, for hosts that limit "
        f"a file's size (the Hugging Face Hub: 50 GB); default 0: one file, {output}.data",
    )


def data_file_bytes(args: argparse.Namespace) -> int | None:
    """--max-data-file-gb in bytes (None: one file); a UserError (one line) for a value that is no size."""
    size = args.max_data_file_gb
    if not (math.isfinite(size) and size >= 0):
        raise UserError(f"--max-data-file-gb {size:g}: give 0 (one file) or a size in GB")
    return int(size * 1e9) or None
