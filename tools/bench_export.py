"""Streaming benchmark of `export_model.py --hf` on a generated multi-GB nemotron-nas checkpoint.

Measures, side by side and each in a fresh child process (peak RSS from /proc VmHWM): a plain copy of the
checkpoint's safetensors files, the bf16 export (weights copied by the kernel in a second thread while the
graph is built with onnx-ir, no torch), and with --convert the float16 export, alternating for
--rounds rounds after one untimed copy (the page cache in the same state for each; `sync` before each).
Bounds: peak RSS <= 1 GB + the largest single tensor, time within 2x of the copy (runtime/bench/export.py).
Default: hidden 2048, 72 layers (every other one attention-free), vocab 32000: about 3.8 GB bf16; needs
about 2.5x that of free disk in --workdir (default /tmp); everything is deleted afterwards.

  python tools/bench_export.py [--workdir DIR] [--rounds 2] [--convert] [--json]
  python tools/bench_export.py --hidden 256 --layers 4 --vocab 1000     # a quick run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from passes.errors import run_cli
from runtime.bench.export import bench


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=72)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--convert", action="store_true", help="also export with --dtype float16")
    parser.add_argument("--rounds", type=int, default=2, help="copy/export rounds, alternating (default 2)")
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary folder in /tmp)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir or "/tmp") as tmp:
        result = bench(
            Path(tmp),
            args.hidden,
            args.heads,
            args.layers,
            args.vocab,
            args.shards,
            args.convert,
            args.rounds,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    print(result.as_json() if args.json else result.report())
    return 0


if __name__ == "__main__":
    run_cli(main)
