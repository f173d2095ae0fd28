"""Predicted decode tokens/s before and after FFN Fusion (analytical model, no GPU).

python tools/latency_model.py [--gpu h100|h200] [--batch 1] [--context 1024] [--json]
"""

from __future__ import annotations

import argparse
import json

from passes.errors import run_cli
from runtime.latency.report import format_paper_report, paper_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=("h100", "h200"), default="h100", help="8x this GPU (default h100)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--context", type=int, default=1024, help="tokens in the KV cache (default 1024)")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (default 8)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args()
    rep = paper_report(args.gpu, batch=args.batch, context=args.context, tp=args.tp)
    print(json.dumps(rep, indent=2) if args.json else format_paper_report(rep))
    return 0


if __name__ == "__main__":
    run_cli(main)
