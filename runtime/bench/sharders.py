"""Side by side: passes.shard and Polygraphy's `polygraphy multi-device shard` (tools/bench.py sharders).

Both sharders run on the same models, each in its own process (runtime.bench.peak_memory measures wall time
and that process's peak RSS), and every set of rank graphs is then run on CPU by runtime.tp.ort.run_simulated
and compared with the single-device model (max |tp - ref| / max |ref|; <= 1e-5 counts as correct).
Polygraphy is fed a hints file made by `polygraphy template shard-hints --parallelism TP --nb-rank N`.
The models are listed in `build_models`.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from exporters.spec import BlockSpec, ModelSpec, super49b_spec
from passes.error_measures import max_abs_relative_error
from passes.io.model_io import load_model, save_model
from passes.io.sessions import open_session
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from passes.shard import count_allreduces
from runtime.bench.peak_memory import Measured, measure
from runtime.tp.ort import run_simulated

TOOLS = Path(__file__).resolve().parents[2] / "tools"
THREADS = {"OMP_NUM_THREADS": "1"}
TOLERANCE = 1e-5
SMALL_BLOCKS = [
    (True, 112),
    (True, 224),
    (False, 60),
    (False, 100),
    (True, 224),
    (False, 56),
    (False, 44),
    (False, 112),
    (True, 224),
]
SMALL_GROUPS = ((1, 3), (5, 7))
BIG_PICK = [0, 1, 6, 7, 8, 11, 12, 42, 43, 44, 45, 46, 52]  # Super-49B blocks: A A - - A - A - - - - - A
BIG_GROUPS = ((1, 3), (7, 10))


@dataclass
class Row:
    model: str
    tp: int
    sharder: str
    ok: bool
    error: float | None
    seconds: float
    peak_mib: float
    allreduces: int | None
    attention_sharded: bool | None
    rank_weight_mib: float | None
    note: str = ""


def _single_device(model: Path, ids: np.ndarray) -> np.ndarray:
    session = open_session(model, threads=1)
    return session.run(None, {"input_ids": ids})[0]


def _rank_bytes(files: list[Path]) -> float:
    """Weight bytes of the largest rank (initializers, inline or external), MiB."""

    sizes = []
    for f in files:
        total = 0
        for t in onnx.load(str(f), load_external_data=False).graph.initializer:
            info = {e.key: e.value for e in t.external_data}
            total += int(info["length"]) if "length" in info else len(t.raw_data)
        sizes.append(total)
    return max(sizes) / 2**20


def _check(
    files: list[Path], model: Path, ids: np.ndarray, reference: np.ndarray
) -> tuple[float | None, str]:
    try:
        return max_abs_relative_error(run_simulated(files, ids), reference), ""
    except Exception as exc:  # a wrong rank graph is a result here, not a crash
        return None, f"runs wrong: {type(exc).__name__}: {str(exc)[:120]}"


def _structure(files: list[Path], branches: int) -> tuple[int, bool]:
    """All-reduces per forward, and whether attention got its own (one per residual branch if so)."""

    reduces = count_allreduces(files[0])
    return reduces, reduces == branches


def run_ours(model: Path, tp: int, out: Path) -> tuple[list[Path], Measured]:
    measured = measure(TOOLS / "shard_tp.py", [model, "--tp", tp, "--out", out, "--quiet"], THREADS)
    out.with_suffix(".log").write_text(measured.output)
    return [out / f"rank{r}" / "model.onnx" for r in range(tp)], measured


def run_polygraphy(model: Path, tp: int, out: Path) -> tuple[list[Path], Measured]:
    out.mkdir(parents=True, exist_ok=True)
    hints = out / "hints.json"
    polygraphy = str(Path(sys.executable).with_name("polygraphy"))
    subprocess.run(
        [
            polygraphy,
            "template",
            "shard-hints",
            str(model),
            "--parallelism",
            "TP",
            "--nb-rank",
            str(tp),
            "-o",
            str(hints),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    target = out / "model.onnx"
    argv = ["multi-device", "shard", model, "-s", hints, "-o", target]
    measured = measure("polygraphy.tools:main", argv, THREADS)
    (out / "shard.log").write_text(measured.output)
    files = [out / f"model_tp{tp}_rank{r}.onnx" for r in range(tp)]
    return files, measured


def compare(
    model_name: str, model: Path, tp: int, work: Path, ids: np.ndarray, reference: np.ndarray, branches: int
) -> list[Row]:
    rows = []
    for sharder, runner in (("passes.shard", run_ours), ("polygraphy", run_polygraphy)):
        out = work / "out" / f"{model_name}_tp{tp}_{sharder.split('.')[0]}"
        files, run = runner(model, tp, out)
        seconds, peak = run.seconds, run.peak_mib
        if run.code != 0 or not all(f.is_file() for f in files):
            rows.append(
                Row(
                    model_name,
                    tp,
                    sharder,
                    False,
                    None,
                    seconds,
                    peak,
                    None,
                    None,
                    None,
                    f"failed: {run.last_line}",
                )
            )
            continue
        error, note = _check(files, model, ids, reference)
        reduces, attention = _structure(files, branches)
        ok = error is not None and error <= TOLERANCE
        rows.append(
            Row(
                model_name,
                tp,
                sharder,
                ok,
                error,
                seconds,
                peak,
                reduces,
                attention,
                _rank_bytes(files),
                note,
            )
        )
    return rows


# ------------------------------------------------------------------------------------------- models


def build_models(work: Path, big_hidden: int) -> dict[str, Path]:
    from exporters.onnx_export import export_spec_model  # noqa: PLC0415 (torch: only to build the models)

    models = work / "models"
    paths = small_models(models, np.random.default_rng(5).integers(0, 256, (2, 16)))
    if big_hidden:
        big, fused = models / f"big{big_hidden}.onnx", models / f"big{big_hidden}.fused.onnx"
        if not fused.exists():
            full = super49b_spec(hidden=big_hidden, heads=8, kv_heads=2, vocab=32000)
            spec = ModelSpec(
                hidden=big_hidden, heads=8, kv_heads=2, vocab=32000, blocks=[full.blocks[i] for i in BIG_PICK]
            )
            export_spec_model(spec, big, seed=3, external_data_threshold=0)
            fuse_file(big, Plan(groups=BIG_GROUPS), fused, validate_output=False)
        paths["big-fused"] = fused
    return paths


def small_models(models: Path, calibration_ids: np.ndarray) -> dict[str, Path]:
    """The small TP models in `models` (each built unless there): m49 (SMALL_BLOCKS), m49-fused
    (SMALL_GROUPS), m49-fp8 (its FP8 Q/DQ, lm_head too, calibrated on `calibration_ids`) and gqa (12 heads,
    2 KV heads, vocab 250, untied lm_head). tests/passes/shard/test_shard.py shards the same models."""
    from exporters.onnx_export import export_spec_model  # noqa: PLC0415 (torch: only to build the models)

    models.mkdir(parents=True, exist_ok=True)
    paths = {
        "m49": models / "m49.onnx",
        "m49-fused": models / "m49.fused.onnx",
        "m49-fp8": models / "m49.fused.fp8.onnx",
        "gqa": models / "gqa.onnx",
    }
    if not paths["m49"].exists():
        spec = ModelSpec(
            hidden=64, heads=8, kv_heads=1, vocab=256, blocks=[BlockSpec(a, w) for a, w in SMALL_BLOCKS]
        )
        export_spec_model(spec, paths["m49"], seed=1, external_data_threshold=0)
    if not paths["m49-fused"].exists():
        fuse_file(paths["m49"], Plan(groups=SMALL_GROUPS), paths["m49-fused"], validate_output=False)
    if not paths["m49-fp8"].exists():
        fp8 = load_model(paths["m49-fused"])
        scales = calibrate(paths["m49-fused"], [calibration_ids], progress=False)
        quantize_fp8(fp8, scales, quantize_lm_head=True)
        save_model(fp8, paths["m49-fp8"], True)
    if not paths["gqa"].exists():
        gqa = ModelSpec(
            hidden=96,
            heads=12,
            kv_heads=2,
            vocab=250,
            tie_embeddings=False,
            blocks=[BlockSpec(True, 40), BlockSpec(False, 36), BlockSpec(True, 48)],
        )
        export_spec_model(gqa, paths["gqa"], seed=2, external_data_threshold=0)
    return paths


def _branch_count(model: Path) -> int:
    return count_allreduces(model)


def format_table(rows: list[Row]) -> str:
    head = (
        "| model | tp | sharder | correct | max rel err | all-reduces | attention sharded | "
        "largest rank weights MiB | time s | peak RSS MiB | note |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        err = "-" if r.error is None else f"{r.error:.1e}"
        attention = "-" if r.attention_sharded is None else ("yes" if r.attention_sharded else "no")
        size = "-" if r.rank_weight_mib is None else f"{r.rank_weight_mib:.1f}"
        lines.append(
            f"| {r.model} | {r.tp} | {r.sharder} | {'yes' if r.ok else 'NO'} | {err} | "
            f"{'-' if r.allreduces is None else r.allreduces} | {attention} | {size} | {r.seconds:.1f} | "
            f"{r.peak_mib:.0f} | {r.note} |"
        )
    return "\n".join(lines)


def run_comparison(work: Path, tps: list[int], big_hidden: int, big_tps: list[int]) -> list[Row]:
    """Every model of `build_models` sharded by both sharders at each TP degree, checked by numbers."""
    rows: list[Row] = []
    for name, model in build_models(work, big_hidden).items():
        vocab = 250 if name == "gqa" else (32000 if name.startswith("big") else 256)
        ids = np.random.default_rng(0).integers(0, vocab, (1, 8) if name.startswith("big") else (2, 11))
        reference = _single_device(model, ids)
        branches = _branch_count(model)
        for tp in big_tps if name.startswith("big") else tps:
            print(f"{name} tp={tp} ...", file=sys.stderr)
            rows.extend(compare(name, model, tp, work, ids, reference, branches))
    return rows
