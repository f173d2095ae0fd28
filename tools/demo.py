"""`make demo`: FFN Fusion on the real SmolLM2-135M with attention removed from blocks 13-22.

The demo starts where a user with a Hugging Face checkpoint starts: a model folder saved by transformers
(config.json, model.safetensors, tokenizer files; here SmolLM2 with attention dropped from blocks 13-22 by
exporters.hf.folder). Export it with `export_model.py --hf` (weights streamed from the safetensors),
analyze block dependencies and propose a plan, fuse and validate, evaluate quality on held-out text, then
generate text with the fused model's KV-cache decode graph. Each step prints the
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


SAVE_FOLDER = "import sys; from exporters.hf.folder import save_smollm2 as s; s(sys.argv[1], range(13, 23))"


def save_folder_once(folder: Path) -> None:
    """SmolLM2 as a Hugging Face folder (what users download from the Hub), attention dropped in 13-22."""
    title = "Save SmolLM2-135M-Instruct as a Hugging Face folder (attention dropped from blocks 13-22)"
    if (folder / "config.json").exists():
        print(f"\n== {title}\n(reusing {folder})")
        return
    print(f"\n== {title}\n$ python -c {shlex.quote(SAVE_FOLDER)} {folder}", flush=True)
    if subprocess.run([sys.executable, "-c", SAVE_FOLDER, str(folder)], cwd=ROOT).returncode != 0:
        raise SystemExit("error: saving the Hugging Face folder failed")


def export_once(title: str, folder: Path, path: Path, *args: object) -> None:
    if path.exists():
        print(f"\n== {title}\n(reusing {path})")
    else:
        step(title, "export_model", "--hf", folder, *args, "-o", path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("demo_out"), help="output folder (default demo_out/)"
    )
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "smollm2_hf"
    model, decode = out / "onnx" / "model.onnx", out / "onnx_decode" / "model.onnx"
    fused, fused_decode = model.with_name("model.fused.onnx"), decode.with_name("model.fused.onnx")
    analysis = out / "analysis"

    save_folder_once(folder)
    export_once(
        "Export the Hugging Face folder to ONNX (config.json, tokenizer copied beside)", folder, model
    )
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
        fused,
    )
    step(
        "Quality on held-out text: original against fused",
        "evaluate",
        model,
        fused,
        "--max-tokens",
        1024,
    )
    step(
        "Heal the fused groups (blockwise local distillation, docs/heal.md): quality before and after",
        "heal",
        model,
        fused,
        "-o",
        model.with_name("model.healed.onnx"),
    )
    export_once(
        "Export the KV-cache decode graph (cache for attention layers only)", folder, decode, "--decode"
    )
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
