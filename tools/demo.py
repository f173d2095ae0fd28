"""`make demo`: attention pruning with local distillation, then FFN Fusion, on the real SmolLM2-135M.

The demo starts where a user with a Hugging Face checkpoint starts: a model folder saved by transformers
(config.json, model.safetensors, tokenizer files; here the unpruned SmolLM2, exporters.hf.folder). It
removes attention from the six layers whose attention matters least, in two runs of three
(tools/prune_attention.py --remove 6 --runs 2: measured importance chooses 5-7 and 25-27), distills each
pruned layer locally and writes a Nemotron-NAS checkpoint; both folders are cached under
~/.cache/ffn-fusion/demo/ after the first run. Then the usual path: export with `export_model.py --hf`,
analyze block dependencies and propose a plan, fuse and validate, heal the fused groups. From there the
quality table of the four models runs in the background (tools/quality.py on the prefill graphs: lm-eval
accuracy through the server, perplexity, KL, top-1; it also shows what healing recovered, so heal.py
evaluates nothing here), while the KV-cache decode graph is exported (onnx-ir, seconds), fused with the same
plan and given the healed weights (heal.py --weights-from), the unpruned, pruned, fused and healed models
answer the same three questions, and the healed model is served and asked them over HTTP; the table is
printed at the end. Last, the healed model is written as one GGUF file (q8_0) with the llama.cpp and
Ollama commands that run it (docs/deploy.md). Each step prints the command it runs, so the demo doubles as
a tutorial, and its CPU and wall time (a table of all steps at the end: on a shared machine the CPU time
says what a quiet one takes).
Outputs go to demo_out/ (exports are reused).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "What is the largest planet in the solar system?",
)
PROMPT = QUESTIONS[0]
CACHE = Path(os.environ.get("FFN_FUSION_CACHE", Path.home() / ".cache" / "ffn-fusion")) / "demo"
# Two runs of three, by importance. The pruning report keeps perplexity, KL and top-1 against surgery; its
# license_mc accuracy (100 items x 3 torch models) is left to the quality table at the end, which scores the
# same items on the unpruned and pruned models through the server: measured once, not twice.
PRUNE_ARGS = ("--remove", 6, "--runs", 2, "--eval-tokens", 1024, "--task-items", 0)


STARTED = time.perf_counter()
TIMES: list[tuple[str, float, float]] = []  # (step, CPU seconds of its processes, wall seconds)


def _cpu() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextmanager
def timed(title: str) -> Iterator[None]:
    """Print and record a step's CPU and wall time: on a shared machine the CPU time is what a quiet one
    would take (a single-threaded step's wall time is about its CPU time; ONNX Runtime uses 2 threads)."""
    cpu, wall = _cpu(), time.perf_counter()
    yield
    cpu, wall = _cpu() - cpu, time.perf_counter() - wall
    TIMES.append((title, cpu, wall))
    print(f"(step time: {cpu:.0f} s CPU, {wall:.0f} s wall)", flush=True)


def step(title: str, tool: str, *args: object) -> None:
    command = [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *map(str, args)]
    shown = " ".join(shlex.quote(str(a)) for a in [f"tools/{tool}.py", *args])
    print(f"\n== {title}\n$ python {shown}", flush=True)
    with timed(title):
        if subprocess.run(command, cwd=ROOT).returncode != 0:
            raise SystemExit(f"error: step '{title}' failed")



@dataclass
class Background:
    """A step running beside the next ones; its output is printed when it is waited for."""

    title: str
    process: subprocess.Popen
    log: Path
    started: float

    def wait(self) -> None:
        _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        print(f"\n== {self.title} (ran in the background)", flush=True)
        print(self.log.read_text(encoding="utf-8", errors="replace"), end="", flush=True)
        cpu, wall = usage.ru_utime + usage.ru_stime, time.perf_counter() - self.started
        TIMES.append((self.title, cpu, wall))
        print(f"(step time: {cpu:.0f} s CPU, {wall:.0f} s wall, beside the steps above)", flush=True)
        if self.process.returncode != 0:
            raise SystemExit(f"error: step '{self.title}' failed")

    def stop(self) -> None:
        """Interrupt it (when a step beside it failed): SIGINT, so that it stops the servers it started."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait()


def background(title: str, tool: str, *args: object) -> Background:
    """Start a tool in the background (its command printed now, its output kept in a log beside)."""
    log = Path(str(args[-1]) + ".log")  # each background tool here ends with its output folder
    command = [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *map(str, args)]
    shown = " ".join(shlex.quote(str(a)) for a in [f"tools/{tool}.py", *args])
    print(f"\n== {title} (in the background; its output follows at the end)\n$ python {shown} > {log}",
          flush=True)
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    return Background(title, process, log, time.perf_counter())

SAVE_FOLDER = "import sys; from exporters.hf.folder import save_smollm2 as s; s(sys.argv[1])"


def save_folder_once(folder: Path) -> None:
    """SmolLM2 as a Hugging Face folder (what users download from the Hub), cached."""
    title = "Save SmolLM2-135M-Instruct as a Hugging Face folder"
    if (folder / "config.json").exists():
        print(f"\n== {title}\n(reusing {folder})")
        return
    print(f"\n== {title}\n$ python -c {shlex.quote(SAVE_FOLDER)} {folder}", flush=True)
    with timed(title):
        if subprocess.run([sys.executable, "-c", SAVE_FOLDER, str(folder)], cwd=ROOT).returncode != 0:
            raise SystemExit("error: saving the Hugging Face folder failed")


def prune_once(folder: Path, pruned: Path, plot: Path) -> list[int]:
    """tools/prune_attention.py (cached): importance, the layers, the local distillation, its table."""
    title = "Remove attention from the 6 least important layers in 2 runs, distill each layer locally"
    if (pruned / "pruning.json").exists():
        print(f"\n== {title}\n(reusing {pruned}; its report:)")
        from runtime.prune.report import QualityRow, format_report  # noqa: PLC0415 (torch: only to print a cached report)

        record = json.loads((pruned / "pruning.json").read_text())
        print(format_report([QualityRow(**row) for row in record["quality"]]))
    else:
        step(title, "prune_attention", folder, *PRUNE_ARGS, "--plot", plot, "-o", pruned)
        record = json.loads((pruned / "pruning.json").read_text())
    return record["removed_attention"]


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
    """tools/serve.py on `model`, the questions as chat requests over HTTP once /health answers, then the
    server stops."""
    port = _free_port()
    args = [model, "--model-name", "healed", "--port", port, "--log-level", "warning"]
    shown = " ".join(shlex.quote(str(a)) for a in ["tools/serve.py", *args])
    print(f"\n== {title}\n$ python {shown} &", flush=True)
    with timed(title):
        _serve_and_ask(title, model, port, args, max_tokens)


def _serve_and_ask(title: str, model: Path, port: int, args: list, max_tokens: int) -> None:
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
        for question in QUESTIONS:
            body = {
                "model": "healed",
                "messages": [{"role": "user", "content": question}],
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
    folder, pruned = CACHE / "smollm2-hf", CACHE / "smollm2-pruned-remove6-runs2"
    # File stems name the rows of tools/quality.py's table (pruned, fused, healed against unpruned).
    unpruned = out / "onnx_unpruned" / "unpruned.onnx"
    model, decode = out / "onnx" / "pruned.onnx", out / "onnx_decode" / "pruned.onnx"
    fused, fused_decode = model.with_name("fused.onnx"), decode.with_name("fused.onnx")
    healed, healed_decode = model.with_name("healed.onnx"), decode.with_name("healed.onnx")
    analysis = out / "analysis"

    save_folder_once(folder)
    removed = prune_once(folder, pruned, out / "importance.png")
    export_once("Export the pruned checkpoint to ONNX (config.json, tokenizer copied beside)", pruned, model)
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
    # --eval-tokens 0: the quality table at the end measures the pruned, fused and healed models on the same
    # held-out text (against the unpruned one); heal.py's own before/after evaluation would be a second one.
    step(
        "Heal the fused groups (blockwise local distillation, docs/heal.md; quality: the table at the end)",
        "heal",
        model,
        fused,
        "--eval-tokens",
        0,
        "-o",
        healed,
    )
    export_once("Export the unpruned model (prefill graph: the quality table's reference)", folder, unpruned)
    # The quality table needs only the prefill graphs: it runs in the background from here (its output is
    # printed at the end), while the decode graph is made and every model answers.
    quality = background(
        "One quality table: lm-eval accuracy through the server, held-out perplexity, KL and top-1 against "
        "the unpruned model",
        "quality", unpruned, model, fused, healed, "--items", 100, "--max-tokens", 2048,
        "--out", out / "quality",
    )  # fmt: skip
    try:
        answer(folder, pruned, plan, healed, decode, fused_decode, healed_decode,
               out / "onnx_decode_unpruned" / "unpruned.onnx")
    except BaseException:
        quality.stop()
        raise
    quality.wait()
    write_gguf(healed, pruned, out / "healed.gguf")
    print(f"\nattention removed from layers {removed}; plan applied: {json.loads(plan.read_text())}; "
          f"outputs in {out}/")
    print_times()


def write_gguf(healed: Path, source: Path, gguf: Path) -> None:
    """The healed model as a GGUF file of llama.cpp's deci architecture, and the commands that run it."""
    gguf.unlink(missing_ok=True)  # the healed graph is written anew on every run
    step("Write the healed model as one GGUF file for llama.cpp and Ollama (q8_0, docs/deploy.md)",
         "export_checkpoint", healed, "--source", source, "--gguf", "--dtype", "q8_0", "-o", gguf)
    print(f"\nrun it with llama.cpp (github.com/ggml-org/llama.cpp; `make llama-cpp` builds it here):\n"
          f"  llama-cli -m {gguf}                      # chat in the terminal\n"
          f"  llama-server -m {gguf} --port 8080       # the OpenAI API, as tools/serve.py\n"
          f"or with Ollama: a file Modelfile holding `FROM ./{gguf.name}` beside it, then\n"
          f"  ollama create healed -f Modelfile && ollama run healed", flush=True)


def answer(folder: Path, pruned: Path, plan: Path, healed: Path, decode: Path, fused_decode: Path,
           healed_decode: Path, unpruned_decode: Path) -> None:
    """The decode graph with the plan and the healed weights, then every model answers the questions."""
    export_once("Export the KV-cache decode graph (cache for attention layers only)", pruned, decode,
                "--decode")
    step("Fuse the decode graph with the same plan", "fuse_onnx", decode, plan, "-o", fused_decode)
    step(
        "Give the fused decode graph the healed weights (no second fit; checked: same model, same plan)",
        "heal",
        decode,
        fused_decode,
        "--weights-from",
        healed,
        "--eval-tokens",
        0,
        "-o",
        healed_decode,
    )
    export_once("Export the unpruned model's decode graph", folder, unpruned_decode, "--decode")
    questions = [arg for q in QUESTIONS for arg in ("--prompt", q)]
    models = {"unpruned": unpruned_decode, "pruned": decode, "fused": fused_decode, "healed": healed_decode}
    for name, path in models.items():
        step(f"Generate with the {name} model", "generate", path, *questions, "--max-new-tokens", 24)
    serve_and_ask("Serve the healed decode graph (OpenAI API) and ask it the questions", healed_decode)

def print_times() -> None:
    """The per-step times (the steps a cached run reused are absent)."""
    print("\n| step | CPU s | wall s |\n| --- | --- | --- |")
    for title, cpu, wall in TIMES:
        print(f"| {title[:70]} | {cpu:.0f} | {wall:.0f} |")
    print(f"| total (wall: from start to end, steps overlap) | {sum(t[1] for t in TIMES):.0f} | "
          f"{time.perf_counter() - STARTED:.0f} |")


if __name__ == "__main__":
    main()
