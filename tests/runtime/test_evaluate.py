"""Quality metrics against direct numpy computations; text sets and windows; the evaluate tool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import UserError
from passes.pipeline import fuse_file
from passes.plan import Plan
from runtime import evaluate as evaluate_module
from runtime import text_sets as text
from runtime.evaluate import evaluate, format_table, kl_total
from runtime.text_sets import TextSet, windows
from tests.run_graph import graph_logits

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = [(True, 48), (False, 64), (False, 40), (False, 56), (True, 32)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("eval")
    original = build_synthetic(SyntheticSpec(blocks=BLOCKS, seed=11), folder / "m.onnx")
    fused = folder / "m.fused.onnx"
    fuse_file(original, Plan(((1, 3),), "last"), fused, validate_output=False)
    return original, fused


def _set(name: str = "t", n: int = 3, length: int = 16, seed: int = 0) -> TextSet:
    ids = np.random.default_rng(seed).integers(0, 64, (n, length), dtype=np.int64)
    return TextSet(name, ids, ("random",))


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """Row by row, as evaluate runs a window (float64 for the log-probabilities)."""
    return np.concatenate([graph_logits(path, row[None]) for row in ids]).astype(np.float64)


def _log_probs(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_model_against_itself(models):
    original, _ = models
    (result,) = evaluate(original, original, [_set()], progress=False)
    assert result.ppl_original == result.ppl_fused
    assert result.top1_agreement == 1.0
    assert result.kl == pytest.approx(0.0, abs=1e-12)
    assert result.logits_cosine == pytest.approx(1.0, abs=1e-12)
    assert result.tokens == 48


@pytest.mark.parametrize("rows", [32, 5])  # 5: blocks of positions that cross windows' ends
def test_metrics_match_numpy(models, monkeypatch, rows):
    monkeypatch.setattr(evaluate_module, "ROWS", rows)
    original, fused = models
    data = _set(n=5, length=12, seed=3)
    (result,) = evaluate(original, fused, [data], batch=2, progress=False)  # batches of 2, 2, 1
    a, b = _logits(original, data.windows), _logits(fused, data.windows)
    la, lb = _log_probs(a), _log_probs(b)
    targets = data.windows[:, 1:]
    nll = [-np.take_along_axis(lp[:, :-1], targets[..., None], -1).mean() for lp in (la, lb)]
    assert result.ppl_original == pytest.approx(np.exp(nll[0]), rel=1e-6)
    assert result.ppl_fused == pytest.approx(np.exp(nll[1]), rel=1e-6)
    assert result.top1_agreement == pytest.approx((a.argmax(-1) == b.argmax(-1)).mean())
    kl = (np.exp(la) * (la - lb)).sum(-1).mean()
    assert result.kl == pytest.approx(kl, rel=1e-5)
    assert result.kl > 1e-5  # fusion is an approximation: the check can fail
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    assert result.logits_cosine == pytest.approx(cos.mean(), rel=1e-9)
    assert result.ppl_fused != result.ppl_original
    assert kl_total(a, b) == pytest.approx(kl * a.shape[0] * a.shape[1], rel=1e-9)  # the frontier's screen


def test_pooled_row_equals_one_set(models):
    original, fused = models
    first, second = _set("a", 2, 16, 1), _set("b", 3, 16, 2)
    results = evaluate(original, fused, [first, second], progress=False)
    assert [r.name for r in results] == ["a", "b", "all"]
    both = TextSet("ab", np.concatenate([first.windows, second.windows]), ("random",))
    (whole,) = evaluate(original, fused, [both], progress=False)
    for key in ("tokens", "ppl_original", "ppl_fused", "top1_agreement", "kl", "logits_cosine"):
        assert getattr(results[-1], key) == pytest.approx(getattr(whole, key), rel=1e-9), key
    table = format_table(results)
    assert table.splitlines()[0].split()[:2] == ["text", "tokens"] and "all" in table


def test_windows_and_default_texts():
    ids = np.arange(300)
    assert windows(ids, 128).shape == (2, 128)
    assert windows(ids, 128, max_tokens=200).shape == (1, 128)
    assert windows(ids[:50], 128).shape == (1, 50)
    with pytest.raises(UserError):
        windows(ids[:0], 128)
    calibration = set(text.CALIBRATION_FILES)
    evaluation = {f for files in text.EVALUATION_FILES.values() for f in files}
    assert not calibration & evaluation  # analysis and evaluation never share text
    assert all(f.is_file() for f in calibration | evaluation)
    assert text.model_tokenizer(None, 64) is None
    ids, source = text.calibration_windows(64, None, 40, 20)
    # a model without a known tokenizer reads the same default text as UTF-8 bytes, every file sampled
    assert ids.shape == (2, 20) and ids.max() <= 63 and "bytes" in source
    assert "Apache-2.0" in source and "difflib.py" in source
    assert ids[0, 0] == ord("\n") and not np.array_equal(ids[0], ids[1])


@pytest.mark.slow
def test_smollm2_tokenizer_texts():
    sets = text.held_out_sets(text.SMOLLM2_VOCAB, None, 128, 64)
    assert [(s.name, s.windows.shape) for s in sets] == [("prose", (2, 64)), ("code", (2, 64))]
    ids, source = text.calibration_windows(text.SMOLLM2_VOCAB, None, 128, 64)
    assert ids.shape == (2, 64) and "Apache-2.0" in source and "SmolLM2" in source
    tokenizer = text.model_tokenizer(None, text.SMOLLM2_VOCAB)
    assert tokenizer.decode(ids[0, :5].tolist()).strip().startswith("Apache")
    assert "GNU" in tokenizer.decode(ids[1].tolist())  # the second window comes from the second file (GPL-2)


def test_evaluate_tool_json(models, tmp_path):
    original, fused = models
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(5).integers(0, 64, 100))
    run = subprocess.run(
        [
            sys.executable,
            "tools/evaluate.py",
            str(original),
            str(fused),
            "--tokens",
            str(ids),
            "--json",
            "--window",
            "32",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    (row,) = report["results"]
    assert row["name"] == "tokens" and row["tokens"] == 96  # 3 windows of 32; the rest dropped
    assert 0 <= row["top1_agreement"] <= 1 and row["kl"] > 0
    table = subprocess.run(
        [sys.executable, "tools/evaluate.py", str(original), str(original), "--tokens", str(ids), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert table.returncode == 0, table.stderr
    assert "1.0000" in table.stdout and "0.0000" in table.stdout
