"""Healing every graph of a model (runtime/heal/transplant.py, shapes.py): the KV-cache decode graph healed
directly and by taking a prefill heal's weights (heal.py --weights-from), mismatches as one line, graphs
with a static batch (run a window at a time) and a static sequence length (--window)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from passes.graph_inputs import Signature
from passes.io.model_io import load_model, save_model
from passes.metadata import HEAL_METADATA_KEY
from passes.pipeline import fuse_file
from passes.plan import Plan
from runtime.generate import DecodeModel, greedy_generate
from runtime.heal.metadata import HealConfig
from runtime.heal.report import run_heal
from tests import decode_fixtures
from tests.artifacts import spec_export
from tests.run_graph import graph_logits

SMALL = HealConfig(steps=4, lr=1e-3, batch_tokens=256)
PROMPT = [17, 41, 8, 60, 22, 9, 33]


def _ids(path: Path, count: int, seed: int) -> Path:
    np.save(path, np.random.default_rng(seed).integers(4, decode_fixtures.tiny_spec().vocab, count))
    return path


def fix_dims(source: Path, target: Path, batch: int | None = None, seq: int | None = None) -> Path:
    """A copy of `source` that declares a static batch and/or sequence length, as exporters that trace one
    example write them: the symbolic dims of input_ids (axis 0, axis 1) replaced by numbers in every value's
    shape."""
    model = load_model(source)
    ids = next(v for v in model.graph.inputs if v.name == "input_ids")
    fixed = {str(dim): size for dim, size in zip(ids.shape, (batch, seq), strict=True) if size is not None}
    values = [*model.graph.inputs, *model.graph.outputs, *(o for n in model.graph for o in n.outputs)]
    for value in values:
        if value.shape is not None:
            value.shape = ir.Shape([d if isinstance(d, int) else fixed.get(str(d), d) for d in value.shape])
    save_model(model, target, external=True)
    return target


@pytest.fixture(scope="module")
def healed(tiny_models, tmp_path_factory):
    """(folder, prefill report): the tiny prefill graph healed with a small fit."""
    folder = tmp_path_factory.mktemp("heal_graphs")
    calib, held = _ids(folder / "calib.npy", 2048, 1), _ids(folder / "held.npy", 512, 2)
    report = run_heal(
        tiny_models("prefill"),
        tiny_models("prefill_fused"),
        folder / "prefill.healed.onnx",
        SMALL,
        calib=[calib],
        heldout=[held],
        window=64,
    )
    return folder, report


def test_decode_graph_takes_the_prefill_heal(tiny_models, healed, tool):
    """--weights-from: the decode graph gets the prefill heal's weights; its logits equal the healed prefill
    graph's, and it generates the greedy tokens of full re-runs of the healed prefill graph."""
    folder, report = healed
    out = folder / "decode.healed.onnx"
    args = ["--heldout", folder / "held.npy", "--window", 64, "--eval-tokens", 128, "--json"]
    result = tool(
        "heal", tiny_models("decode"), tiny_models("decode_fused"), "--weights-from",
        report.result.output, *args, "-o", out,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["weights_from"] == str(report.result.output)
    assert printed["groups"] == report.to_json()["groups"]  # the heal's own records, carried over
    assert printed["quality_after"][-1]["kl"] < 0.5 * printed["quality_before"][-1]["kl"]
    written = json.loads(load_model(out).metadata_props[HEAL_METADATA_KEY])
    assert written["weights_from"] == printed["weights_from"]

    ids = np.array([PROMPT])
    healed_prefill, healed_decode = graph_logits(report.result.output, ids), graph_logits(out, ids)
    fused = graph_logits(tiny_models("prefill_fused"), ids)
    assert np.abs(healed_decode - healed_prefill).max() <= 1e-5 * np.abs(healed_prefill).max()
    assert np.abs(healed_prefill - fused).max() > 1e-3 * np.abs(fused).max()  # the weights did change

    generated = greedy_generate(DecodeModel.open(out), [PROMPT], 6).tokens[0]
    sequence = list(PROMPT)
    for _ in range(6):
        sequence.append(int(graph_logits(report.result.output, np.array([sequence]))[0, -1].argmax()))
    assert list(generated) == sequence[len(PROMPT) :]


def test_decode_graph_heals_directly(tiny_models, healed, tmp_path):
    """The decode graph healed on its own (its streams from ONNX Runtime with an empty cache) fits what the
    prefill graph's heal fits."""
    folder, report = healed
    direct = run_heal(
        tiny_models("decode"), tiny_models("decode_fused"), tmp_path / "d.onnx", SMALL,
        calib=[folder / "calib.npy"], heldout=[folder / "held.npy"], window=64, eval_tokens=0,
    )
    for a, b in zip(report.result.groups, direct.result.groups, strict=True):
        assert b.start_sha256 == a.start_sha256
        assert b.heldout_after == pytest.approx(a.heldout_after, rel=1e-4), (a.line(), b.line())


def test_weights_from_mismatch_is_one_line(tiny_models, healed, tmp_path, tool):
    """Another plan, another original, a model heal.py did not write: `error:`, exit 2, nothing written."""
    folder, report = healed
    other_plan = fuse_file(
        tiny_models("decode"), Plan(((0, 1), (4, 6)), "fold"), tmp_path / "plan.onnx", validate_output=False
    ).output
    other = spec_export(decode_fixtures.tiny_spec(), tmp_path / "other.onnx", seed=7, decode=True)
    other_fused = fuse_file(
        other, Plan(decode_fixtures.TINY_GROUPS, "fold"), tmp_path / "other.fused.onnx", validate_output=False
    ).output
    cases = {
        "another plan": ([tiny_models("decode"), other_plan, report.result.output], "healed with plan"),
        "another original": ([other, other_fused, report.result.output], "is not the model"),
        "not healed": (
            [tiny_models("decode"), tiny_models("decode_fused"), tiny_models("prefill_fused")],
            f"no {HEAL_METADATA_KEY} metadata",
        ),
    }
    for name, ((original, fused, source), message) in cases.items():
        out = tmp_path / f"{name.replace(' ', '_')}.onnx"
        result = tool("heal", original, fused, "--weights-from", source, "--calib", folder / "calib.npy",
                      "--heldout", folder / "held.npy", "--window", 64, "-o", out)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (name, result.stderr)
        assert lines[0].startswith("error: ") and message in lines[0], (name, lines)
        assert not out.exists() and not list(tmp_path.glob(f".{out.name}*"))


def test_static_batch_heals_a_window_at_a_time(tiny_models, healed, tmp_path, tool):
    """A graph whose batch is fixed at 1 runs one window at a time (and says so): the same fit and KL."""
    folder, report = healed
    original = fix_dims(tiny_models("prefill"), tmp_path / "s1.onnx", batch=1)
    fused = fix_dims(tiny_models("prefill_fused"), tmp_path / "s1.fused.onnx", batch=1)
    assert Signature.of(original).batch == 1
    result = tool("heal", original, fused, "--steps", SMALL.steps, "--lr", SMALL.lr, "--batch-tokens",
                  SMALL.batch_tokens, "--calib", folder / "calib.npy", "--heldout", folder / "held.npy",
                  "--window", 64, "--json", "-o", tmp_path / "s1.healed.onnx")
    assert result.returncode == 0, result.stderr
    static = json.loads(result.stdout)
    dynamic = report.to_json()
    assert static["quality_after"][-1]["kl"] == pytest.approx(dynamic["quality_after"][-1]["kl"], rel=1e-4)
    for a, b in zip(dynamic["groups"], static["groups"], strict=True):
        assert b["heldout_after"] == pytest.approx(a["heldout_after"], rel=1e-4)
    progress = tool("heal", original, fused, "--calib", folder / "calib.npy", "--heldout",
                    folder / "held.npy", "--window", 64, "--eval-tokens", 0, "-o", tmp_path / "again.onnx")
    assert "fixes its batch at 1: 40 windows run 1 at a time (40 runs)" in progress.stdout, progress.stdout


def test_static_sequence_length_sets_the_window(tiny_models, healed, tmp_path, tool):
    """A graph that fixes its sequence length: windows of that length by default; another --window is one
    line naming the flag."""
    folder, _ = healed
    original = fix_dims(tiny_models("prefill"), tmp_path / "s.onnx", seq=32)
    fused = fix_dims(tiny_models("prefill_fused"), tmp_path / "s.fused.onnx", seq=32)
    common = ["--calib", folder / "calib.npy", "--heldout", folder / "held.npy", "--eval-tokens", 0]
    result = tool("heal", original, fused, *common, "--window", 64, "-o", tmp_path / "bad.onnx")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "takes exactly 32 tokens" in result.stderr and "pass --window 32" in result.stderr
    assert not (tmp_path / "bad.onnx").exists()
    result = tool("heal", original, fused, *common, "-o", tmp_path / "ok.onnx")
    assert result.returncode == 0, result.stderr
    assert "64 x 32 tokens" in result.stdout, result.stdout
