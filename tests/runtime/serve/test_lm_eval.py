"""EleutherAI's lm-evaluation-harness through the service (DESIGN 11): `lm_eval --model local-completions`
against tools/serve.py serving Optimum's export of SmolLM2 (attention dropped from 13-22; the corpus) and
its fused model (passes.pipeline.fuse_file), on a small multiple-choice task made here from license prose.
Every per-choice loglikelihood equals lm-eval's own `hf` backend on the Hugging Face folder (for the fused
model: the same folder with each group replaced by its parallel sum, tests/torch_reference.py) within
0.02 nats, with the same accuracy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from passes.pipeline import fuse_file
from passes.plan import Plan
from runtime.lm_tasks import CHOICES, license_task
from tests.corpora.fixtures import GROUPS
from tests.runtime.serve.clients import launch_cli, wait_healthy

TASK = "license_mc"
ITEMS = 8
TOLERANCE = 0.02  # nats
NORM = "fold"
SERVED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _environment(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def lm_eval_served(url: str, model: str, hf: Path, task: Path, out: Path, env: dict) -> subprocess.Popen:
    """The harness as a user runs it against the server (DESIGN 11), started in the background."""
    command = [
        str(Path(sys.executable).parent / "lm_eval"),
        "--model",
        "local-completions",
        "--model_args",
        f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={hf}",
        "--batch_size",
        "8",
        "--tasks",
        TASK,
        "--include_path",
        str(task),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def samples_of(out: Path) -> list[dict]:
    (path,) = out.glob(f"*/samples_{TASK}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return sorted(rows, key=lambda r: r["doc_id"])


def loglikelihoods(samples: list[dict]) -> list[list[float]]:
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def hf_references(hf: Path, task: Path, groups) -> dict[str, list[dict]]:
    """lm-eval's `hf` backend in this process on the folder's model: as it is ("original"), then with
    `groups` replaced by their parallel sums ("fused"; the same model object, changed in place)."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only this reference needs it)
    from lm_eval import simple_evaluate  # noqa: PLC0415 (lm_eval: seconds to import; only this reference needs it)
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415 (lm_eval: seconds to import; only this reference needs it)
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 (lm_eval: seconds to import; only this reference needs it)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only this reference needs it)

    from tests.torch_reference import parallel_model  # noqa: PLC0415 (imports torch: only this reference needs it)

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    lm = HFLM(pretrained=model, tokenizer=str(hf), batch_size=8, device="cpu")
    tasks = TaskManager(include_path=str(task), include_defaults=False)  # no index of lm-eval's own tasks

    def run() -> list[dict]:
        results = simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, log_samples=True)
        return sorted(results["samples"][TASK], key=lambda r: r["doc_id"])

    original = run()
    parallel_model(model, groups, NORM)
    return {"original": original, "fused": run()}


@pytest.mark.slow
def test_lm_eval_through_the_service_matches_its_hf_backend(
    third_party_corpus, corpus_hf, tmp_path, monkeypatch
):
    task = license_task(tmp_path / "task")
    env = _environment(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE"):  # the in-process reference
        monkeypatch.setenv(name, env[name])
    original = third_party_corpus["optimum"].parent
    fused = tmp_path / "fused"
    fuse_file(original / "model.onnx", Plan(GROUPS, NORM), fused / "model.onnx")  # validated
    for name in SERVED_FILES:
        shutil.copy(original / name, fused / name)

    servers, runs = [], {}
    try:
        for name, folder in (("original", original), ("fused", fused)):  # both load at once
            # prompts prefilled (and scored) in chunks of 16 tokens: lm-eval's numbers must not move
            args = [str(folder), "--model-name", name, "--log-level", "warning", "--prefill-chunk", "16"]
            servers.append(launch_cli(*args))
        for (process, url, command), name in zip(servers, ("original", "fused"), strict=True):
            wait_healthy(process, url, command)
            runs[name] = lm_eval_served(url, name, corpus_hf, task, tmp_path / name, env)
        references = hf_references(corpus_hf, task, GROUPS)
        for run in runs.values():
            output, _ = run.communicate(timeout=300)
            assert run.returncode == 0, output[-3000:]
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
        for process, _, _ in servers:
            process.terminate()
            process.wait(timeout=30)

    scores = {name: loglikelihoods(samples_of(tmp_path / name)) for name in runs}
    for name, reference in references.items():
        served = samples_of(tmp_path / name)
        assert [s["doc_id"] for s in served] == list(range(ITEMS))
        assert all(len(row) == CHOICES for row in scores[name])
        worst = largest_difference(scores[name], loglikelihoods(reference))
        assert worst < TOLERANCE, (name, worst)
        assert [s["acc"] for s in served] == [s["acc"] for s in reference], name
    # the fused server serves the fused model: its scores moved away from the original's
    assert largest_difference(scores["fused"], loglikelihoods(references["original"])) > 10 * TOLERANCE
