"""One quality table for an original model and its variants (fused, healed, ...): lm-eval accuracy through
tools/serve.py (lm-eval's local-completions), and perplexity, KL(original || model) and next-token top-1
agreement against the original on held-out text. Writes OUT/table.md and OUT/table.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.cli import parse, tool_parser
from runtime.quality import LmEvalTasks, markdown_table, quality

EPILOG = """\
examples:
  quality.py onnx/model.onnx onnx/model.fused.onnx onnx/model.healed.onnx
  quality.py model.onnx model.fused.onnx --items 50 --out quality/
  quality.py model.onnx model.fused.onnx --tasks my_task --include-path my_tasks/ --tokenizer hf_folder/

default task: license_mc, made offline from /usr/share/common-licenses/GPL-3 (runtime/lm_tasks.py): the
first 8 words of a sentence, and 4 choices of the next 3 words. Held-out text: the prose and code sets of
evaluate.py (or --text). Each model is served in turn on a free port and stopped afterwards; lm-eval's
results and logs stay in OUT/lm_eval/NAME/.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tool_parser("quality.py", __doc__, EPILOG)
    parser.add_argument("original", type=Path, help="the original ONNX model")
    parser.add_argument("variants", type=Path, nargs="+", help="models to compare with it (fused, healed)")
    parser.add_argument(
        "--tokenizer", type=Path, help="Hugging Face tokenizer folder (default: the original's folder)"
    )
    parser.add_argument("--tasks", help="lm-eval task names, comma-separated (default: license_mc)")
    parser.add_argument("--include-path", type=Path, help="folder of your own lm-eval task YAMLs")
    parser.add_argument("--limit", type=int, help="items per task (lm-eval --limit; default all)")
    parser.add_argument("--items", type=int, default=100, help="items of license_mc (default 100)")
    parser.add_argument("--text", type=Path, nargs="+", metavar="FILE", help="held-out text file(s)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens per text set (default 4096)")
    parser.add_argument("--window", type=int, default=128, help="tokens per window (default 128)")
    parser.add_argument("--out", type=Path, default=Path("quality"), help="output folder (default quality/)")
    return parse(parser, argv, "items", "max_tokens", "window")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tasks = None
    if args.tasks:
        tasks = LmEvalTasks(tuple(t.strip() for t in args.tasks.split(",") if t.strip()), args.include_path,
                            args.limit)
    elif args.include_path or args.limit:
        raise UserError("--include-path and --limit go with --tasks (license_mc's size is --items)")
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1")
    if args.include_path and not args.include_path.is_dir():
        raise UserError(f"--include-path {args.include_path} is not a folder")
    rows = quality(
        args.original,
        args.variants,
        args.out,
        tokenizer=args.tokenizer,
        tasks=tasks,
        items=args.items,
        texts=args.text,
        window=args.window,
        max_tokens=args.max_tokens,
        log=print,
    )
    print(markdown_table(rows))
    print(f"wrote {args.out / 'table.md'} and {args.out / 'table.json'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
