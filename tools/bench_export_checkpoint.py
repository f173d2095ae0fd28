"""Streaming benchmark of `export_checkpoint.py` on a generated multi-GB fused model.

Side by side, each in a fresh child process (peak RSS from /proc VmHWM): a plain copy of the fused graph's
data file, and tools/export_checkpoint.py writing it as a Nemotron-NAS checkpoint (bf16 kept) and, with
--gguf, as a GGUF file of each dtype asked for; alternating for --rounds rounds after one untimed copy
(`sync` before each step). Bounds (issues 36 and 47): at most 1.2x the copy's time, at most 256 MB peak RSS
(runtime/bench/export_checkpoint.py). Default: hidden 2048, 72 layers (every other one attention-free), vocab
32000, 8 fused pairs: about 3.8 GB bf16; needs about 4x that of free disk in --workdir (default /tmp; 6x with
--gguf f32); everything is deleted afterwards.

  python tools/bench_export_checkpoint.py [--workdir DIR] [--rounds 2] [--json]
  python tools/bench_export_checkpoint.py --layers 92 --gguf f32,q8_0 [--no-checkpoint]
  python tools/bench_export_checkpoint.py --hidden 256 --layers 4 --vocab 1000 --groups 2    # a quick run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.bench.export_checkpoint import bench


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=72)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="fused pairs [2k, 2k + 1] (default 8)")
    parser.add_argument("--rounds", type=int, default=2, help="copy/export rounds, alternating (default 2)")
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary folder in /tmp)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--gguf", nargs="?", const="f32,q8_0", default="", metavar="DTYPES",
                        help="also time export_checkpoint.py --gguf for these dtypes (default f32,q8_0)")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="time the GGUF writer only (with --gguf)")
    args = parser.parse_args()
    gguf = [d for d in args.gguf.split(",") if d]
    if bad := [d for d in gguf if d not in ("f32", "f16", "bf16", "q8_0")]:
        raise UserError(f"--gguf {','.join(bad)}: choose among f32, f16, bf16, q8_0")
    if args.no_checkpoint and not gguf:
        raise UserError("--no-checkpoint leaves nothing to time without --gguf")
    if not 0 <= 2 * args.groups <= args.layers:
        raise UserError(f"--groups {args.groups}: between 0 and layers / 2 ({args.layers // 2})")
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir or "/tmp") as tmp:
        result = bench(Path(tmp), args.hidden, args.heads, args.layers, args.vocab, args.shards, args.groups,
                       args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True), gguf=gguf,
                       checkpoint_step=not args.no_checkpoint)
    print(result.as_json() if args.json else result.table())
    return 0


if __name__ == "__main__":
    run_cli(main)
