"""The argparse pieces the tools share (runtime/cli.py), as the tools use them."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli import add_options, add_token_source, parse, tool_parser


def _parser(text_first: bool = False):
    parser = tool_parser("t.py", "First line.\n  kept as written", "examples:\n  t.py --text a.txt")
    add_token_source(parser, "calibration", text_first)
    add_options(parser, [("--window", {"type": int, "default": 128, "help": "tokens per window"})])
    return parser


def test_help_keeps_the_docstring_and_epilog_as_written_and_the_source_order():
    help_text = _parser().format_help()
    assert "First line.\n  kept as written" in help_text and "examples:\n  t.py --text a.txt" in help_text
    assert help_text.index("--tokens IDS.npy") < help_text.index("--text FILE")
    assert "calibration token ids (.npy)" in help_text and "calibration text file(s)" in help_text
    flipped = _parser(text_first=True).format_help()
    assert flipped.index("--text FILE") < flipped.index("--tokens IDS.npy")


def test_parse_reads_the_options_and_refuses_a_count_below_one(capsys):
    args = parse(_parser(), ["--text", "a.txt", "b.txt", "--window", "3"], "window")
    assert args.text == [Path("a.txt"), Path("b.txt")] and args.tokens is None and args.window == 3
    with pytest.raises(SystemExit) as exit_:
        parse(_parser(), ["--window", "0"], "window")
    assert exit_.value.code == 2 and "t.py: error: --window must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(_parser(), ["--text", "a.txt", "--tokens", "ids.npy"])
    assert "not allowed with argument" in capsys.readouterr().err
