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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from passes.errors import run_cli

TOOLS = Path(__file__).resolve().parent
MB = 1 << 20


# Runs a script in a fresh interpreter and prints its own peak RSS (VmHWM) last. (ru_maxrss from wait4
# is no good here: Linux carries the parent's resident size at fork across exec into it.)
PEAK_WRAPPER = """
import runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
finally:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
    print(f"peak_rss_kb={hwm}", file=sys.stderr)
"""


BUILD = """
import sys
from exporters import synthetic
hidden, ffn, blocks, path = sys.argv[1:]
spec = synthetic.SyntheticSpec(hidden=int(hidden), vocab=256, blocks=[(False, int(ffn))] * int(blocks))
synthetic.build_synthetic(spec, path, external=True)
"""


def run_child(script: Path | str, *args: object) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of `script args` run in a fresh process."""
    command = [sys.executable, "-c", PEAK_WRAPPER, str(script), *map(str, args)]
    start = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"error: {script} failed: {result.stderr[-500:]}")
    peak_kb = int(result.stderr.rsplit("peak_rss_kb=", 1)[1].split()[0])
    return seconds, peak_kb * 1024


def copy_files(model: Path, target: Path) -> tuple[float, int]:
    target.mkdir()
    script = target.parent / "copy.py"
    script.write_text("import shutil, sys\nfor p in sys.argv[2:]:\n    shutil.copy(p, sys.argv[1])\n")
    return run_child(script, target, model, f"{model}.data")


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
    print(
        f"building {args.blocks} blocks, hidden {args.hidden}, FFN {args.ffn} (fp32, external data) ...",
        file=sys.stderr,
    )
    model = work / "model.onnx"
    build = [sys.executable, "-c", BUILD, str(args.hidden), str(args.ffn), str(args.blocks), str(model)]
    subprocess.run(build, check=True)  # in a child, so that this process stays small
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
    runs = (("fuse", ["--no-validate", "-o", work / "a.onnx"]), ("fuse_validate", ["-o", work / "b.onnx"]))
    for name, extra in runs:
        print(f"running {name} ...", file=sys.stderr)
        results[f"{name}_s"], results[f"{name}_peak_rss"] = run_child(
            TOOLS / "fuse_onnx.py", model, plan, *extra
        )
        results[f"{name}_vs_copy"] = results[f"{name}_s"] / results["copy_s"]
    return results


def report(results: dict) -> str:
    bound = results["bound_bytes"]
    lines = [
        f"model: {results['model_bytes'] / 1e9:.2f} GB; "
        f"largest group: {results['largest_group_bytes'] / MB:.0f} MB; RSS bound: {bound / MB:.0f} MB",
        f"{'step':<16}{'seconds':>9}{'x copy':>8}{'peak RSS MB':>13}  within bounds",
        f"{'copy':<16}{results['copy_s']:>9.1f}{1.0:>8.2f}{results['copy_peak_rss'] / MB:>13.0f}",
    ]
    for name in ("fuse", "fuse_validate"):
        rss = results[f"{name}_peak_rss"]
        # The time bound (3x a copy) is for fusing; validation is held to the memory bound only.
        ok = rss < bound and (name != "fuse" or results[f"{name}_vs_copy"] <= 3.0)
        seconds, ratio = results[f"{name}_s"], results[f"{name}_vs_copy"]
        lines.append(f"{name:<16}{seconds:>9.1f}{ratio:>8.2f}{rss / MB:>13.0f}  {'yes' if ok else 'NO'}")
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
