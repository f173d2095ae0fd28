"""One quality table for an original model and its variants (fused, healed, ...): lm-eval accuracy through
the served model, and perplexity / KL / top-1 agreement against the original on held-out text.

For each model in turn (one server at a time): tools/serve.py starts on a free port, `lm_eval --model
local-completions` scores the task(s) through it (DESIGN 11; default: the offline license_mc task of
runtime.lm_tasks), and the server stops (always). Accuracy (acc, acc_norm and acc's standard error) is read
from lm-eval's results JSON. Meanwhile, in a thread, runtime.evaluate compares each variant with the
original on the held-out text (the original's logits run once: ReferenceRun; one variant's session at a
time), tokenized with the same tokenizer folder lm-eval uses; the original's own row is the reference (KL
0, top-1 1, its perplexity from the first comparison). Memory: one served model, one compared model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from passes.errors import UserError
from runtime.evaluate import QualityResult, ReferenceRun
from runtime.lm_tasks import LICENSE_TASK, license_task
from runtime.ports import free_port
from runtime.text_sets import TextSet, held_out_sets, is_tokenizer_folder

# tools/serve.py is started as a program (as a user starts it), not imported
SERVE = Path(__file__).resolve().parents[1] / "tools" / "serve.py"
HEALTH_TIMEOUT_S = 300


@dataclass(frozen=True)
class TaskScore:
    task: str
    items: int
    acc: float
    acc_stderr: float | None
    acc_norm: float | None


@dataclass(frozen=True)
class QualityRow:
    name: str
    model: str  # the ONNX file
    scores: tuple[TaskScore, ...]
    tokens: int  # held-out positions compared
    perplexity: float
    kl: float  # mean KL(original || this model), nats per position
    top1: float  # fraction of positions where this model's top token is the original's


@dataclass(frozen=True)
class LmEvalTasks:
    names: tuple[str, ...]
    include_path: Path | None
    limit: int | None = None  # items per task (lm-eval --limit)


def lm_eval_program() -> Path:
    """The lm_eval command beside this Python, else on PATH (UserError when neither)."""
    beside = Path(sys.executable).parent / "lm_eval"
    found = beside if beside.is_file() else shutil.which("lm_eval")
    if not found:
        raise UserError("lm_eval is not installed: pip install 'lm-eval[api]'")
    return Path(found)


def default_tokenizer(model: Path) -> Path:
    """The folder beside the model when it holds a Hugging Face tokenizer (as exporters leave it)."""
    return model.parent


def check_inputs(models: Sequence[Path], tokenizer: Path) -> None:
    for path in models:
        if not path.is_file():
            raise UserError(f"model {path} does not exist")
    if not is_tokenizer_folder(tokenizer):
        raise UserError(f"{tokenizer} holds no tokenizer.json or tokenizer_config.json: pass --tokenizer "
                        "with the model's Hugging Face folder")


def model_names(original: Path, variants: Sequence[Path]) -> list[str]:
    """"original", then each variant's file stem without the original's (model.fused.onnx -> fused),
    made unique with -2, -3, ..."""
    names = ["original"]
    for path in variants:
        name = path.stem.removeprefix(original.stem + ".") or path.stem
        base, k = name, 2
        while name in names:
            name, k = f"{base}-{k}", k + 1
        names.append(name)
    return names


def _environment(offline: bool, cache: Path) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(cache)}
    if offline:  # the local task needs nothing from the Hub; never wait on the network for it
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return env


def _wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            raise UserError(f"the server stopped ({lines[-1] if lines else 'no output'}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise UserError(f"the server did not answer /health within {HEALTH_TIMEOUT_S} s; see {log}")


def served_lm_eval(
    model: Path,
    name: str,
    tokenizer: Path,
    tasks: LmEvalTasks,
    out: Path,
    env: dict[str, str],
    batch: int = 8,
) -> list[TaskScore]:
    """Serve `model` with tools/serve.py, run lm-eval through it into `out`, stop the server."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve_log = out / "serve.log"
    with serve_log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, str(SERVE), str(model), "--port", str(port), "--model-name", name,
             "--log-level", "warning"],
            stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_healthy(server, url, serve_log)
        command = [
            str(lm_eval_program()), "--model", "local-completions",
            "--model_args",
            f"model={name},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer}",
            "--batch_size", str(batch), "--tasks", ",".join(tasks.names),
            "--output_path", str(out / "results"),
        ]  # fmt: skip
        if tasks.include_path is not None:
            command += ["--include_path", str(tasks.include_path)]
        if tasks.limit is not None:
            command += ["--limit", str(tasks.limit)]
        lm_log = out / "lm_eval.log"
        with lm_log.open("w") as sink:
            done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        if done.returncode != 0:
            lines = lm_log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            raise UserError(f"lm_eval failed on {name} ({lines[-1] if lines else 'no output'}); see {lm_log}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return read_scores(out / "results")


def read_scores(folder: Path) -> list[TaskScore]:
    """acc, its standard error and acc_norm of every task in lm-eval's newest results_*.json under
    `folder`."""
    found = sorted(folder.glob("**/results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UserError(f"lm_eval wrote no results_*.json under {folder}")
    data = json.loads(found[-1].read_text(encoding="utf-8"))
    samples = data.get("n-samples", {})
    scores = []
    for task, metrics in data["results"].items():
        if "acc,none" not in metrics:
            continue
        stderr, norm = metrics.get("acc_stderr,none"), metrics.get("acc_norm,none")
        scores.append(
            TaskScore(
                task,
                int(samples.get(task, {}).get("effective", 0)),
                float(metrics["acc,none"]),
                float(stderr) if isinstance(stderr, int | float) else None,
                float(norm) if norm is not None else None,
            )
        )
    if not scores:
        raise UserError(f"{found[-1]} reports no acc metric: use multiple-choice (loglikelihood) tasks")
    return scores


def quality(
    original: Path,
    variants: Sequence[Path],
    out: Path,
    tokenizer: Path | None = None,
    tasks: LmEvalTasks | None = None,
    items: int = 100,
    texts: Sequence[Path] | None = None,
    window: int = 128,
    max_tokens: int = 4096,
    log: Callable[[str], None] = lambda message: None,
) -> list[QualityRow]:
    """Rows for the original and each variant (module docstring); writes `out`/table.md and table.json.
    `tasks` None: the license_mc task with `items` items, written to `out`/task."""
    tokenizer = tokenizer or default_tokenizer(original)
    models = [original, *variants]
    check_inputs(models, tokenizer)
    missing = [str(p) for p in texts or [] if not p.is_file()]
    if missing:
        raise UserError(f"text file {', '.join(missing)} does not exist")
    lm_eval_program()
    # before anything is written or served; the tokenizer lm-eval reads, so no vocabulary is needed
    sets = held_out_sets(None, texts, max_tokens, window, tokenizer)
    names = model_names(original, variants)
    offline = tasks is None
    if tasks is None:  # checks `items` before anything is written
        tasks = LmEvalTasks((LICENSE_TASK,), license_task(out / "task", items))
    out.mkdir(parents=True, exist_ok=True)
    log(f"held-out text: {', '.join(f'{s.name} {s.tokens} tokens' for s in sets)}")
    # The held-out comparison runs beside lm-eval (ONNX Runtime releases the GIL; lm-eval and the servers
    # are other processes): on two cores the servers' small batches leave a core to it.
    stop = threading.Event()  # set when lm-eval fails: the comparison ends after its current model
    with ThreadPoolExecutor(1) as pool:
        held_out = pool.submit(_held_out, original, variants, names, sets, out, log, stop)
        try:
            scores = _lm_eval_scores(names, models, tokenizer, tasks, out, offline, log)
        except BaseException:
            stop.set()
            raise
        compared = held_out.result()
    reference = (compared[0].tokens, compared[0].ppl_original)
    rows = [QualityRow("original", str(original), tuple(scores["original"]), *reference, 0.0, 1.0)]
    for name, model, result in zip(names[1:], variants, compared, strict=True):
        rows.append(
            QualityRow(name, str(model), tuple(scores[name]), result.tokens, result.ppl_fused, result.kl,
                       result.top1_agreement)
        )
    (out / "table.md").write_text(markdown_table(rows) + "\n", encoding="utf-8")
    record = {
        "original": str(original),
        "tokenizer": str(tokenizer),
        "tasks": list(tasks.names),
        "include_path": str(tasks.include_path) if tasks.include_path else None,
        "texts": {s.name: list(s.files) for s in sets},
        "window": window,
        "rows": [asdict(r) for r in rows],
    }
    (out / "table.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return rows


def _lm_eval_scores(
    names: Sequence[str], models: Sequence[Path], tokenizer: Path, tasks: LmEvalTasks, out: Path,
    offline: bool, log: Callable[[str], None],
) -> dict[str, list[TaskScore]]:
    """Each model served in turn and scored by lm-eval (one server at a time)."""
    scores = {}
    with tempfile.TemporaryDirectory() as cache:
        env = _environment(offline, Path(cache))
        for name, model in zip(names, models, strict=True):
            log(f"lm-eval {','.join(tasks.names)} on {name} ({model}) ...")
            started = time.monotonic()
            scores[name] = served_lm_eval(model, name, tokenizer, tasks, out / "lm_eval" / name, env)
            summary = ", ".join(f"{s.task} acc {s.acc:.4f}" for s in scores[name])
            log(f"  {summary} ({time.monotonic() - started:.0f} s)")
    return scores


def _held_out(
    original: Path, variants: Sequence[Path], names: Sequence[str], sets: Sequence[TextSet], out: Path,
    log: Callable[[str], None], stop: threading.Event,
) -> list[QualityResult]:
    """Each variant against the original on the held-out sets (pooled); the original's logits run once."""
    compared = []
    with tempfile.TemporaryDirectory(dir=out, prefix=".logits.") as logits:
        reference = ReferenceRun(original, sets, Path(logits), progress=False)
        for name, model in zip(names[1:] or ["original"], variants or [original], strict=True):
            if stop.is_set():
                break
            started = time.monotonic()
            compared.append(reference.compare(model, progress=False)[-1])  # pooled "all" when several
            log(f"held-out text: perplexity, KL and top-1 of {name} against the original "
                f"({time.monotonic() - started:.0f} s)")
    return compared


def markdown_table(rows: Sequence[QualityRow]) -> str:
    """Columns: model, per task acc ± stderr (n items) and acc_norm, perplexity, KL, top-1 agreement."""
    tasks = [(s.task, s.items) for s in rows[0].scores]
    norms = {s.task for r in rows for s in r.scores if s.acc_norm is not None}
    header = ["model"]
    for task, n in tasks:
        header.append(f"{task} acc (n={n})")
        if task in norms:
            header.append(f"{task} acc_norm")
    header += ["perplexity", "KL(original‖model)", "top-1 agreement"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.name]
        by_task = {s.task: s for s in row.scores}
        for task, _ in tasks:
            score = by_task.get(task)
            stderr = f" ± {score.acc_stderr:.3f}" if score and score.acc_stderr is not None else ""
            cells.append(f"{score.acc:.3f}{stderr}" if score else "")
            if task in norms:
                cells.append(f"{score.acc_norm:.3f}" if score and score.acc_norm is not None else "")
        cells += [f"{row.perplexity:.3f}", f"{row.kl:.4f}", f"{row.top1:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
