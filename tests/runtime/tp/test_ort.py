"""The CPU tensor-parallel runtime: real torchrun launches (gloo all-reduces) against one device, the
segment split, and TensorRT-RTX ahead-of-time builds of every rank graph (DistCollective included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from exporters.hf.checkpoint import export_hf
from passes.error_measures import max_abs_relative_error
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.shard import count_allreduces, shard_file
from passes.shard.partition import HeadPlan
from runtime.tp.ort import RankProgram, run_simulated, split_rank_graph
from runtime.tp.trt import build_rank_engines
from tests import shard_forms
from tests.passes.shard.test_shard import TOLERANCE, TpModels, build_models, single_device, tokens

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def models() -> TpModels:
    return build_models()


def _torchrun(
    tp: int, dirs: list[Path], outs: list[Path], ids: Path, timeout: float = 240
) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    port = 29500 + 17 * tp + os.getpid() % 97
    command = [
        str(torchrun),
        "--nproc-per-node",
        str(tp),
        "--master-port",
        str(port),
        str(ROOT / "tools" / "run_tp.py"),
        *map(str, dirs),
        "--tokens",
        str(ids),
        "--out",
        *map(str, outs),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_torchrun_logits_equal_single_device(models: TpModels, tmp_path: Path, tp: int) -> None:
    """One launch per tp runs the unfused and the fused Super-49B-pattern model (N processes, gloo)."""
    ids = tokens(seq=13)
    np.save(tmp_path / "ids.npy", ids)
    sources = [models.unfused, models.fused]
    dirs = [tmp_path / f"{m.stem}_tp{tp}" for m in sources]
    for model, directory in zip(sources, dirs, strict=True):
        shard_file(model, tp, directory, progress=False)
    outs = [d.with_suffix(".npy") for d in dirs]
    run = _torchrun(tp, dirs, outs, tmp_path / "ids.npy")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    for model, out in zip(sources, outs, strict=True):
        logits = np.load(out)
        assert logits.dtype == np.float32 and logits.shape == (2, 13, 256)
        error = max_abs_relative_error(logits, single_device(model, ids))
        assert error <= TOLERANCE, f"{model.name} tp={tp}: relative error {error:.2e}"


# ------------------------------------------------------------------------------------------ SmolLM2's heads

# SmolLM2-135M's attention shape (9 heads, 3 KV heads: padded to 16 heads in 4 KV slots at tp=8) at hidden 72,
# random weights, as a Nemotron-NAS checkpoint exported by export_hf (seconds): the real model's head plan
# without its 135M weights (its third-party graphs shard over gloo in tests/passes/shard/test_corpus.py).
SMOLLM2_HEADS_ATTENTION = (True, True, False, False, False, False, True, True)
SMOLLM2_HEADS_GROUPS = ((1, 3), (4, 5))
SMOLLM2_HEADS_VOCAB = 160


@pytest.fixture(scope="module")
def smollm2_heads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(unfused, fused): the SmolLM2-headed model and its attention-free run fused in two groups."""
    from exporters.hf.synthetic import deci_block, nemotron_config, write_nemotron  # noqa: PLC0415 (imports torch: only this fixture needs it)

    blocks = [deci_block(3 if attention else "no_op", 1.0) for attention in SMOLLM2_HEADS_ATTENTION]
    base = tmp_path_factory.mktemp("smollm2_heads")
    config = nemotron_config(blocks, hidden=72, heads=9, vocab=SMOLLM2_HEADS_VOCAB, tie=True)
    unfused = export_hf(write_nemotron(base / "ckpt", config), base / "unfused.onnx", dtype="float32").path
    fuse_file(unfused, Plan(groups=SMOLLM2_HEADS_GROUPS), base / "fused.onnx")
    return unfused, base / "fused.onnx"


def _over_gloo(sources: list[Path], tp: int, tmp_path: Path) -> list[float]:
    """Shard each source at `tp`, run all of them in one torchrun launch, return the relative errors."""
    ids = np.random.default_rng(tp).integers(0, SMOLLM2_HEADS_VOCAB, (2, 9)).astype(np.int64)
    np.save(tmp_path / "ids.npy", ids)
    dirs = [tmp_path / f"{m.stem}_tp{tp}" for m in sources]
    attention_blocks = sum(SMOLLM2_HEADS_ATTENTION)
    for model, directory in zip(sources, dirs, strict=True):
        report = shard_file(model, tp, directory, progress=False)
        attention = [b for b in report.branches if b.kind == "attention"]
        assert len(attention) == attention_blocks and all(b.heads == 9 and b.kv_heads == 3 for b in attention)
        assert {b.heads_per_rank for b in attention} == {HeadPlan(9, 3, tp).heads_per_rank}
    outs = [d.with_suffix(".npy") for d in dirs]
    run = _torchrun(tp, dirs, outs, tmp_path / "ids.npy", timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    pairs = zip(sources, outs, strict=True)
    return [max_abs_relative_error(np.load(o), single_device(m, ids)) for m, o in pairs]


@pytest.mark.slow
def test_smollm2_heads_tp8_over_gloo(smollm2_heads: tuple[Path, Path], tmp_path: Path) -> None:
    """SmolLM2's 9 heads and 3 KV heads (padded to 16 heads in 4 KV slots), unfused and fused, 8 torchrun
    processes with gloo all-reduces, equal one device."""
    errors = _over_gloo(list(smollm2_heads), 8, tmp_path)
    assert max(errors) <= TOLERANCE, f"relative errors {errors}"


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_smollm2_heads_tp2_tp4_over_gloo(smollm2_heads: tuple[Path, Path], tmp_path: Path, tp: int) -> None:
    """The fused model at tp=2 (KV heads 3 -> 4 slots, 2 per rank) and tp=4 (one slot per rank)."""
    errors = _over_gloo([smollm2_heads[1]], tp, tmp_path)
    assert max(errors) <= TOLERANCE, f"relative errors {errors}"


@pytest.mark.slow
def test_attention_forms_over_gloo(tmp_path: Path) -> None:
    """Every third-party attention form (tests/shard_forms.py, 9 heads / 3 KV heads) at tp=4 in one
    torchrun launch: Where masks, packed qkv, opset-23 Attention, TorchScript, ORT's Skip norms."""
    sources = [shard_forms.forms_model(name) for name in shard_forms.FORMS]
    ids = np.random.default_rng(3).integers(0, shard_forms.VOCAB, (2, 7)).astype(np.int64)
    np.save(tmp_path / "ids.npy", ids)
    dirs = [tmp_path / m.stem for m in sources]
    for model, directory in zip(sources, dirs, strict=True):
        shard_file(model, 4, directory, progress=False)
    outs = [d.with_suffix(".npy") for d in dirs]
    run = _torchrun(4, dirs, outs, tmp_path / "ids.npy")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    for model, out in zip(sources, outs, strict=True):
        error = max_abs_relative_error(np.load(out), single_device(model, ids))
        assert error <= TOLERANCE, f"{model.name} tp=4: relative error {error:.2e}"


def test_segments_cut_at_every_collective(models: TpModels, tmp_path: Path) -> None:
    report = shard_file(models.fused, 2, tmp_path / "tp2", progress=False)
    segments, inputs, outputs = split_rank_graph(report.rank_files[0])
    assert inputs == ["input_ids"] and outputs == ["logits"]
    assert len(segments) == count_allreduces(models.fused) + 1 == 10
    assert [s.collective is not None for s in segments] == [True] * 9 + [False]
    proto = onnx.load(str(report.rank_files[0]), load_external_data=False)
    n_nodes = sum(n.op_type != "DistCollective" for n in proto.graph.node)
    assert sum(len(s.model.graph.node) for s in segments if s.model is not None) == n_nodes
    for seg in segments[1:]:
        # every later segment reads the all-reduced stream (the previous collective's output)
        assert any(name.endswith("_all_reduce") for name in seg.inputs)
    program = RankProgram(report.rank_files[1])
    assert len(program.collectives) == 9


def test_runs_polygraphy_rank_graphs(models: TpModels, tmp_path: Path) -> None:
    """Polygraphy appends its DistCollective nodes after all others (not topologically sorted) and
    only shards the FFNs of this model; the runtime sorts the nodes and still matches one device."""
    prefix = tmp_path / "poly" / "m49.onnx"
    prefix.parent.mkdir()
    polygraphy = str(Path(sys.executable).with_name("polygraphy"))
    command = [
        polygraphy,
        "multi-device",
        "shard",
        str(models.unfused),
        "--one-shot",
        "--parallelism",
        "TP",
        "--nb-rank",
        "2",
        "-o",
        str(prefix),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    files = [prefix.with_name(f"m49_tp2_rank{r}.onnx") for r in range(2)]
    assert count_allreduces(files[0]) == 9  # FFNs only; its TP needs an AttentionPlugin for attention
    ids = tokens()
    error = max_abs_relative_error(run_simulated(files, ids), single_device(models.unfused, ids))
    assert error <= TOLERANCE


@pytest.mark.slow
def test_rank_graphs_build_with_tensorrt_rtx(models: TpModels, tmp_path: Path) -> None:
    """Each rank's FP8 graph (strongly typed Q/DQ + DistCollective) parses and builds for sm89."""
    pytest.importorskip("tensorrt_rtx")
    shard_file(models.fused_fp8, 2, tmp_path / "tp2", progress=False)
    builds = build_rank_engines(tmp_path / "tp2", batch=(1, 1, 2), seq=(1, 16, 64))
    assert [b.rank for b in builds] == [0, 1]
    for b in builds:
        assert b.collective_layers == 9
        assert b.engine.is_file() and b.plan_bytes > 100_000
