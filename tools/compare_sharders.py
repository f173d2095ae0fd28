"""Side by side: passes.shard (tools/shard_tp.py) and Polygraphy's `polygraphy multi-device shard`.

Both sharders run on the same models, each in its own process (wall time and that process's peak RSS
are measured), and every set of rank graphs is then run on CPU by runtime.tp.ort.run_simulated and compared
with the single-device model (max |tp - ref| / max |ref|; <= 1e-5 counts as correct). Polygraphy is fed
a hints file made by `polygraphy template shard-hints --parallelism TP --nb-rank N`.

Examples:
  python tools/compare_sharders.py                         # small models, tp 2 4 8, plus a ~0.6 GB model
  python tools/compare_sharders.py --big-hidden 0          # small models only
  python tools/compare_sharders.py --work /tmp/cmp --json results.json

Models (exported by exporters.onnx_export, fused by passes.pipeline, FP8 by passes.quant.fp8):
  m49        Super-49B pattern, 8 heads / 1 KV head, hidden 64, 9 blocks (4 attention), FFN widths
             60/100/44 that 8 does not divide
  m49-fused  the same with groups [1,3] and [5,7] fused (one FFN of 384 and one of 212)
  m49-fp8    m49-fused with FP8 Q/DQ (per-channel weights, per-tensor activations)
  gqa        12 heads / 2 KV heads, hidden 96, untied lm_head
  big-fused  Super-49B pattern at hidden 1024 (8 heads / 2 KV heads, vocab 32000), 13 blocks with two
             groups fused, external data
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from passes.errors import run_cli
from runtime.bench.sharders import format_table, run_comparison


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for models and outputs (default: a temp dir)"
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--big-hidden", type=int, default=1024, help="hidden size of big-fused (0: skip it)")
    parser.add_argument("--big-tp", type=int, nargs="+", default=[8], help="tp values for big-fused")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="compare_sharders_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {work}", file=sys.stderr)
    rows = run_comparison(work, args.tp, args.big_hidden, args.big_tp)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
