"""tools/quality.py end to end on the tiny decode model (word-level tokenizer, tests/serve_fixtures.py): each
model served by tools/serve.py and scored by the real lm_eval on an 8-item task of runtime.lm_tasks made
from words of its vocabulary; perplexity / KL / top-1 from runtime.evaluate. The same file given twice
scores the same; the fused model (plan TINY_GROUPS) moves away from the original."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from runtime.lm_tasks import choice_task
from tests import serve_fixtures as sf

TASK = "tiny_mc"


def word_text(path: Path, sentences: int = 24) -> Path:
    """Sentences of 12-20 words of the tiny vocabulary ("w4" ... "w95"), seeded."""
    rng = random.Random(1)
    lines = [" ".join(f"w{rng.randrange(4, 96)}" for _ in range(rng.randrange(12, 21))) + "." for _ in
             range(sentences)]
    path.write_text(" ".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.getbasetemp()
    folder = tmp_path_factory.mktemp("quality_inputs")
    text = word_text(folder / "words.txt")
    return {
        "original": sf.tiny_folder(base) / "model.onnx",
        "fused": sf.tiny_folder(base, "decode_fused") / "model.onnx",
        "text": text,
        "tasks": choice_task(folder / "tasks", text.read_text(encoding="utf-8"), TASK, 8),
    }


@pytest.mark.slow  # about 40 s: three lm_eval runs
def test_quality_table_of_original_fused_and_a_copy(tool, inputs, tmp_path):
    out = tmp_path / "quality"
    original = inputs["original"]
    result = tool(
        "quality", original, inputs["fused"], original, "--tasks", TASK, "--include-path", inputs["tasks"],
        "--text", inputs["text"], "--window", 32, "--max-tokens", 256, "--out", out, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["name"]: r for r in json.loads((out / "table.json").read_text())["rows"]}
    assert list(rows) == ["original", "model", "model-2"]  # the fused file, then the original again
    for row in rows.values():
        (score,) = row["scores"]
        assert score["task"] == TASK and score["items"] == 8
        assert 0 <= score["acc"] <= 1 and 0 <= score["acc_norm"] <= 1
        assert row["tokens"] == 256 and row["perplexity"] > 1
    assert rows["original"]["kl"] == 0 and rows["original"]["top1"] == 1
    same, fused = rows["model-2"], rows["model"]
    assert same["scores"] == rows["original"]["scores"]
    assert same["kl"] == pytest.approx(0, abs=1e-9) and same["top1"] == 1
    assert same["perplexity"] == pytest.approx(rows["original"]["perplexity"], rel=1e-9)
    assert fused["kl"] > 1e-4 and fused["perplexity"] != pytest.approx(rows["original"]["perplexity"])
    table = (out / "table.md").read_text()
    assert f"| {TASK} acc (n=8) |" in table and len(table.splitlines()) == 5  # header, rule, 3 rows
    assert (out / "lm_eval" / "model" / "serve.log").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.onnx", "{original}"], "model missing.onnx does not exist"),
        (["{original}", "{original}", "--tokenizer", "{tmp}"], "holds no tokenizer.json"),
        (["{original}", "{original}", "--text", "nothing.txt"], "text file nothing.txt does not exist"),
        (["{original}", "{original}", "--items", "500"], "asked for 500 items"),
        (["{original}", "{original}", "--limit", "5"], "--include-path and --limit go with --tasks"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tool, inputs, tmp_path, args, message):
    out = tmp_path / "out"
    filled = [a.format(original=inputs["original"], tmp=tmp_path) for a in args]
    result = tool("quality", *filled, "--out", out)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and message in result.stderr
    assert not out.exists()
