"""`make demo`: FFN Fusion on the real SmolLM2-135M with attention removed from blocks 13-22.

Export, analyze block dependencies and propose a plan, fuse and validate, evaluate quality on
held-out text, then generate text with the fused model's KV-cache decode graph. Each step prints the
command it runs, so the demo doubles as a tutorial. Outputs go to demo_out/ (exports are reused).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France?"


def step(title: str, tool: str, *args: object) -> None:
    command = [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *map(str, args)]
    shown = " ".join(shlex.quote(str(a)) for a in [f"tools/{tool}.py", *args])
    print(f"\n== {title}\n$ python {shown}", flush=True)
    if subprocess.run(command, cwd=ROOT).returncode != 0:
        raise SystemExit(f"error: step '{title}' failed")


def export_once(title: str, path: Path, *args: object) -> None:
    if path.exists():
        print(f"\n== {title}\n(reusing {path})")
    else:
        step(title, "export_model", "--smollm2", "--drop-attention", "13-22", *args, "-o", path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("demo_out"), help="output folder (default demo_out/)"
    )
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    model, decode = out / "smollm2_pruned.onnx", out / "smollm2_pruned_decode.onnx"
    analysis = out / "analysis"

    export_once("Export SmolLM2-135M-Instruct, attention removed from blocks 13-22", model)
    step("The block table", "fuse_onnx", model, "--show-blocks")
    step(
        "Block dependencies (paper section 3) and a proposed plan",
        "analyze",
        model,
        "--out",
        analysis,
        "--num-tokens",
        64,
    )
    plan = analysis / "plan.json"
    print(f"\nheatmap: {analysis / 'dependency.png'}\nplan: {plan.read_text().strip()}")
    step(
        "Fuse the proposed plan, then validate against the original and the parallel-sum reference",
        "fuse_onnx",
        model,
        plan,
        "-o",
        out / "smollm2_pruned.fused.onnx",
    )
    step(
        "Quality on held-out text: original against fused",
        "evaluate",
        model,
        out / "smollm2_pruned.fused.onnx",
        "--max-tokens",
        1024,
    )
    export_once("Export the KV-cache decode graph (cache for attention blocks only)", decode, "--decode")
    fused_decode = out / "smollm2_pruned_decode.fused.onnx"
    step("Fuse the decode graph with the same plan", "fuse_onnx", decode, plan, "-o", fused_decode)
    for name, path in (("original", decode), ("fused", fused_decode)):
        step(
            f"Generate with the {name} pruned model",
            "generate",
            path,
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            24,
        )
    print(
        "\nNote: attention was removed from blocks 13-22 without the distillation the paper applies, so the\n"
        "pruned model writes poor text before and after fusion; the unpruned SmolLM2 answers 'The capital\n"
        "of France is Paris.' Fusion's own cost is the evaluation table above."
    )
    print(f"plan applied: {json.loads(plan.read_text())}; outputs in {out}/")


if __name__ == "__main__":
    main()
