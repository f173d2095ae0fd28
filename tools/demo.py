"""`make demo`: FFN Fusion on the real SmolLM2-135M with attention removed from blocks 13-22.

The demo starts where a user with a Hugging Face checkpoint starts: a model folder saved by transformers
(config.json, model.safetensors, tokenizer files; here SmolLM2 with attention dropped from blocks 13-22 by
exporters.hf.folder). Export it with `export_model.py --hf` (weights streamed from the safetensors),
analyze block dependencies and propose a plan, fuse and validate, evaluate quality on held-out text, heal
the fused groups, then export the KV-cache decode graph, fuse it with the same plan, give it the healed
weights (heal.py --weights-from), generate with it, and serve it: the demo ends with the healed model
answering a chat request through tools/serve.py. Each step prints the command it runs, so the demo doubles
as a tutorial. Outputs go to demo_out/ (exports are reused).
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_ask(title: str, model: Path, max_tokens: int = 24) -> None:
    """tools/serve.py on `model`, one chat request over HTTP once /health answers, then the server stops."""
    port = _free_port()
    args = [model, "--model-name", "healed", "--port", port, "--log-level", "warning"]
    shown = " ".join(shlex.quote(str(a)) for a in ["tools/serve.py", *args])
    print(f"\n== {title}\n$ python {shown} &", flush=True)
    process = subprocess.Popen([sys.executable, str(ROOT / "tools" / "serve.py"), *map(str, args)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: step '{title}' failed: the server did not start")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        body = {
            "model": "healed",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        print(f"$ curl {url}/v1/chat/completions -d '{json.dumps(body)}'", flush=True)
        request = urllib.request.Request(
            url + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            reply = json.load(response)
        print(f"assistant: {reply['choices'][0]['message']['content']!r}")
    finally:
        process.terminate()
        process.wait(timeout=60)


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
    healed_decode = decode.with_name("model.healed.onnx")
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
    step(
        "Give the fused decode graph the healed weights (no second fit; checked: same model, same plan)",
        "heal",
        decode,
        fused_decode,
        "--weights-from",
        model.with_name("model.healed.onnx"),
        "--eval-tokens",
        0,
        "-o",
        healed_decode,
    )
    for name, path in (("original", decode), ("fused", fused_decode), ("healed", healed_decode)):
        step(
            f"Generate with the {name} pruned model",
            "generate",
            path,
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            24,
        )
    serve_and_ask("Serve the healed decode graph (OpenAI API) and ask it one question", healed_decode)
    print(
        "\nNote: attention was removed from blocks 13-22 without the distillation the paper applies, so the\n"
        "pruned model writes poor text before and after fusion; the unpruned SmolLM2 answers 'The capital\n"
        "of France is Paris.' Fusion's cost is the evaluation table above; healing's gain is heal.py's table."
    )
    print(f"plan applied: {json.loads(plan.read_text())}; outputs in {out}/")


if __name__ == "__main__":
    main()
