"""Quality of a fused model against its original on held-out text: perplexity of each, next-token top-1
agreement, mean KL(original || fused) and logits cosine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from passes.errors import UserError, run_cli
from passes.io.model_io import load_model
from passes.model_map import find_blocks, vocab_size
from runtime.cli import add_token_source, parse, tool_parser
from runtime.evaluate import evaluate, format_table
from runtime.text_sets import CALIBRATION_FILES, held_out_sets

EPILOG = """\
examples:
  evaluate.py model.onnx model.fused.onnx                 default held-out prose and code
  evaluate.py model.onnx model.fused.onnx --text a.txt --json
  evaluate.py model.onnx model.fused.onnx --tokens ids.npy --max-tokens 1024

default texts: prose = /usr/share/common-licenses/{GPL-3, MPL-2.0, Artistic, CC0-1.0, BSD}; code = the
Python standard library's argparse.py, textwrap.py, json/decoder.py, fractions.py. The calibration text
of analyze.py, heal.py and build_engines.py (runtime/text_sets.py CALIBRATION_FILES) is not among them.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tool_parser("evaluate.py", __doc__, EPILOG)
    parser.add_argument("original", type=Path, help="the original ONNX model")
    parser.add_argument("fused", type=Path, help="the model to compare with it (e.g. model.fused.onnx)")
    add_token_source(parser, "evaluation", text_first=True)
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens per text set (default 4096)")
    parser.add_argument("--window", type=int, default=128, help="tokens per window (default 128)")
    parser.add_argument("--batch", type=int, default=4, help="windows per ONNX Runtime call (default 4)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parse(parser, argv, "max_tokens", "window", "batch")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for path in (args.original, args.fused):
        if not path.is_file():
            raise UserError(f"model {path} does not exist")
    vocab = vocab_size(find_blocks(load_model(args.original)))
    overlap = [str(p) for p in args.text or [] if p.resolve() in {c.resolve() for c in CALIBRATION_FILES}]
    if overlap:
        print(
            f"warning: {', '.join(overlap)} is the default calibration text (not held out)", file=sys.stderr
        )
    if args.tokens is not None and args.tokens.suffix != ".npy":  # held_out_sets tells token files by it
        raise UserError(f"--tokens {args.tokens}: token ids come in an .npy file")
    source = [args.tokens] if args.tokens is not None else args.text
    sets = held_out_sets(vocab, source, args.max_tokens, args.window)
    log = (lambda m: None) if args.json else (lambda m: print(m))
    results = evaluate(args.original, args.fused, sets, args.batch, progress=not args.quiet, log=log)
    if args.json:
        print(
            json.dumps(
                {
                    "original": str(args.original),
                    "fused": str(args.fused),
                    "window": args.window,
                    "texts": {s.name: list(s.files) for s in sets},
                    "results": [r.row() for r in results],
                },
                indent=1,
            )
        )
    else:
        print(format_table(results))
    return 0


if __name__ == "__main__":
    run_cli(main)
