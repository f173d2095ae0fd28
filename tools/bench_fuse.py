"""Scale benchmark of the fusion pass: peak memory and time on a multi-GB FFN-only model.

Builds a synthetic model (default: hidden 2048, FFN 8192, 24 attention-free blocks, fp32 external data,
about 4.8 GB), then in one run measures, side by side:
  - a plain copy of the model's files (the I/O floor),
  - tools/fuse_onnx.py with groups of --group blocks, without and with validation,
each in a fresh child process whose peak RSS is read from the kernel (wait4). The bound to meet:
peak RSS < largest group's weight bytes + 512 MB, and fusing within 3x of the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import run_cli

TOOLS = Path(__file__).resolve().parent
MB = 1 << 20


def run_child(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of a child process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"error: {' '.join(command)} failed: {process.stderr.read().decode()[-500:]}")
    return seconds, usage.ru_maxrss * 1024


def copy_files(model: Path, target: Path) -> tuple[float, int]:
    target.mkdir()
    code = "import shutil, sys; [shutil.copy(p, sys.argv[1]) for p in sys.argv[2:]]"
    files = [str(model), str(model) + ".data"]
    return run_child([sys.executable, "-c", code, str(target), *files])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--group", type=int, default=4, help="blocks per fused group")
    parser.add_argument("--workdir", type=Path, help="where to build the model (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser.parse_args()


def bench(args: argparse.Namespace, work: Path) -> dict:
    spec = SyntheticSpec(hidden=args.hidden, vocab=256, blocks=[(False, args.ffn)] * args.blocks)
    print(
        f"building {args.blocks} blocks, hidden {args.hidden}, FFN {args.ffn} (fp32, external data) ...",
        file=sys.stderr,
    )
    model = build_synthetic(spec, work / "model.onnx", external=True)
    model_bytes = model.stat().st_size + Path(str(model) + ".data").stat().st_size
    groups = [[i, min(i + args.group, args.blocks) - 1] for i in range(0, args.blocks, args.group)]
    plan = work / "plan.json"
    plan.write_text(json.dumps({"groups": [g for g in groups if g[1] > g[0]], "norm": "fold"}))
    group_bytes = 3 * args.hidden * args.ffn * 4 * args.group
    results = {
        "model_bytes": model_bytes,
        "largest_group_bytes": group_bytes,
        "bound_bytes": group_bytes + 512 * MB,
    }
    print("copying the model's files ...", file=sys.stderr)
    results["copy_s"], results["copy_peak_rss"] = copy_files(model, work / "copy")
    fuse = [sys.executable, str(TOOLS / "fuse_onnx.py"), str(model), str(plan)]
    for name, extra in (
        ("fuse", ["--no-validate", "-o", str(work / "a.onnx")]),
        ("fuse_validate", ["-o", str(work / "b.onnx")]),
    ):
        print(f"running {name} ...", file=sys.stderr)
        results[f"{name}_s"], results[f"{name}_peak_rss"] = run_child(fuse + extra)
        results[f"{name}_vs_copy"] = results[f"{name}_s"] / results["copy_s"]
    return results


def report(results: dict) -> str:
    bound = results["bound_bytes"]
    lines = [
        f"model: {results['model_bytes'] / 1e9:.2f} GB; largest group: {results['largest_group_bytes'] / MB:.0f} MB; "
        f"RSS bound: {bound / MB:.0f} MB",
        f"{'step':<16}{'seconds':>9}{'x copy':>8}{'peak RSS MB':>13}  within bound",
        f"{'copy':<16}{results['copy_s']:>9.1f}{1.0:>8.2f}{results['copy_peak_rss'] / MB:>13.0f}",
    ]
    for name in ("fuse", "fuse_validate"):
        rss = results[f"{name}_peak_rss"]
        ok = rss < bound and results[f"{name}_vs_copy"] <= 3.0
        lines.append(
            f"{name:<16}{results[f'{name}_s']:>9.1f}{results[f'{name}_vs_copy']:>8.2f}{rss / MB:>13.0f}  {'yes' if ok else 'NO'}"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        results = bench(args, Path(tmp))
    print(json.dumps(results, indent=1) if args.json else report(results))
    return 0


if __name__ == "__main__":
    run_cli(main)
