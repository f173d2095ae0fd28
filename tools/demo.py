"""`make demo`: the main job on the real SmolLM2-135M with attention removed from blocks 13-22.

Each step prints the command it runs, so the demo doubles as a tutorial. Outputs go to demo_out/.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def step(title: str, tool: str, *args: object) -> None:
    command = [sys.executable, str(TOOLS / f"{tool}.py"), *map(str, args)]
    shown = " ".join(shlex.quote(str(a)) for a in [f"tools/{tool}.py", *args])
    print(f"\n== {title}\n$ python {shown}", flush=True)
    result = subprocess.run(command, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"error: step '{title}' failed with exit status {result.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "demo_out", help="output folder (default demo_out/)"
    )
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = out / "smollm2_pruned.onnx"
    if model.exists():
        print(f"(reusing {model.relative_to(ROOT) if model.is_relative_to(ROOT) else model})")
    else:
        step(
            "Export SmolLM2-135M-Instruct, attention removed from blocks 13-22",
            "export_model",
            "--smollm2",
            "--drop-attention",
            "13-22",
            "-o",
            model,
        )
    step("The block table", "fuse_onnx", model, "--show-blocks")
    plan = out / "plan.json"
    plan.write_text(json.dumps({"groups": [[13, 17], [18, 21]], "norm": "fold"}) + "\n")
    print(f"\nplan: {plan.read_text().strip()}  (block 22, the run's last FFN, stays out: paper 5.3)")
    step("Fuse, then validate against the original and the parallel-sum reference", "fuse_onnx", model, plan)


if __name__ == "__main__":
    main()
