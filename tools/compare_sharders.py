"""Side by side: passes.shard (tools/shard_tp.py) and Polygraphy's `polygraphy multi-device shard`.

Both sharders run on the same models, each in its own process (wall time and that process's peak RSS
are measured), and every set of rank graphs is then run on CPU by runtime.tp.run_simulated and compared
with the single-device model (max |tp - ref| / max |ref|; <= 1e-5 counts as correct). Polygraphy is fed
a hints file made by `polygraphy template shard-hints --parallelism TP --nb-rank N`.

Examples:
  python tools/compare_sharders.py                         # small models, tp 2 4 8, plus a ~0.6 GB model
  python tools/compare_sharders.py --big-hidden 0          # small models only
  python tools/compare_sharders.py --work /tmp/cmp --json results.json

Models (exported by exporters.onnx_export, fused by passes.pipeline, FP8 by passes.fp8):
  m49        Super-49B pattern, 8 heads / 1 KV head, hidden 64, 9 blocks (4 attention), FFN widths
             60/100/44 that 8 does not divide
  m49-fused  the same with groups [1,3] and [5,7] fused (one FFN of 384 and one of 212)
  m49-fp8    m49-fused with FP8 Q/DQ (per-channel weights, per-tensor activations)
  gqa        12 heads / 2 KV heads, hidden 96, untied lm_head
  big-fused  Super-49B pattern at hidden 1024 (8 heads / 2 KV heads, vocab 32000), 13 blocks with two
             groups fused, external data
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from passes.errors import UserError, run_cli

ROOT = Path(__file__).resolve().parents[1]
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

# Runs a function in this child process and reports its wall time and peak RSS (VmHWM, KiB).
_MEASURE = """
import json, resource, sys, time, importlib
module, func, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.argv = [sys.argv[4]] + sys.argv[5:]
start = time.perf_counter()
code = 0
try:
    result = getattr(importlib.import_module(module), func)()
    code = result if isinstance(result, int) else 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
except Exception as exc:  # report, do not hide
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    code = 1
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for line in open("/proc/self/status"):  # VmHWM: this program's own peak (ru_maxrss counts the parent's)
    if line.startswith("VmHWM:"):
        peak = int(line.split()[1])
json.dump({"code": code, "seconds": seconds, "peak_kib": peak}, open(out, "w"))
"""


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


def _measure(module: str, func: str, argv: list[str], log: Path) -> tuple[int, float, float, str]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report = Path(f.name)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), str(ROOT)]),
    }
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, module, func, str(report), *argv],
        capture_output=True,
        text=True,
        env=env,
    )
    log.write_text(run.stdout + run.stderr)
    data = (
        json.loads(report.read_text()) if report.stat().st_size else {"code": 1, "seconds": 0, "peak_kib": 0}
    )
    report.unlink(missing_ok=True)
    tail = (run.stderr.strip().splitlines() or [""])[-1][:160]
    return int(data["code"]), float(data["seconds"]), data["peak_kib"] / 1024, tail


def _single_device(model: Path, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


def _rank_bytes(files: list[Path]) -> float:
    """Weight bytes of the largest rank (initializers, inline or external), MiB."""
    import onnx

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
    from runtime.tp import relative_error, run_simulated

    try:
        return relative_error(run_simulated(files, ids), reference), ""
    except Exception as exc:  # a wrong rank graph is a result here, not a crash
        return None, f"runs wrong: {type(exc).__name__}: {str(exc)[:120]}"


def _structure(files: list[Path], branches: int) -> tuple[int, bool]:
    """All-reduces per forward, and whether attention got its own (one per residual branch if so)."""
    from passes.shard import count_allreduces

    reduces = count_allreduces(files[0])
    return reduces, reduces == branches


def run_ours(model: Path, tp: int, out: Path) -> tuple[list[Path], tuple[int, float, float, str]]:
    argv = ["shard_tp.py", str(model), "--tp", str(tp), "--out", str(out), "--quiet"]
    measured = _measure("shard_tp", "main", argv, out.with_suffix(".log"))
    files = [out / f"rank{r}" / "model.onnx" for r in range(tp)]
    return files, measured


def run_polygraphy(model: Path, tp: int, out: Path) -> tuple[list[Path], tuple[int, float, float, str]]:
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
    argv = ["polygraphy", "multi-device", "shard", str(model), "-s", str(hints), "-o", str(target)]
    measured = _measure("polygraphy.tools", "main", argv, out / "shard.log")
    files = [out / f"model_tp{tp}_rank{r}.onnx" for r in range(tp)]
    return files, measured


def compare(
    model_name: str, model: Path, tp: int, work: Path, ids: np.ndarray, reference: np.ndarray, branches: int
) -> list[Row]:
    rows = []
    for sharder, runner in (("passes.shard", run_ours), ("polygraphy", run_polygraphy)):
        out = work / "out" / f"{model_name}_tp{tp}_{sharder.split('.')[0]}"
        files, (code, seconds, peak, tail) = runner(model, tp, out)
        if code != 0 or not all(f.is_file() for f in files):
            rows.append(
                Row(model_name, tp, sharder, False, None, seconds, peak, None, None, None, f"failed: {tail}")
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
    from exporters.onnx_export import export_spec_model
    from exporters.spec import BlockSpec, ModelSpec, super49b_spec
    from passes.fp8 import calibrate, quantize_fp8
    from passes.model_io import load_model, save_model
    from passes.pipeline import fuse_file
    from passes.plan import Plan

    models = work / "models"
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
        ids = np.random.default_rng(5).integers(0, 256, (2, 16))
        fp8 = load_model(paths["m49-fused"])
        quantize_fp8(fp8, calibrate(paths["m49-fused"], [ids], progress=False), quantize_lm_head=True)
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


def _branch_count(model: Path) -> int:
    from passes.shard import count_allreduces

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for models and outputs (default: a temp dir)"
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--big-hidden", type=int, default=1024, help="hidden size of big-fused (0: skip it)")
    parser.add_argument("--big-tp", type=int, nargs="+", default=[8], help="tp values for big-fused")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="compare_sharders_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {work}", file=sys.stderr)
    paths = build_models(work, args.big_hidden)
    rows: list[Row] = []
    for name, model in paths.items():
        vocab = 250 if name == "gqa" else (32000 if name.startswith("big") else 256)
        ids = np.random.default_rng(0).integers(0, vocab, (1, 8) if name.startswith("big") else (2, 11))
        reference = _single_device(model, ids)
        branches = _branch_count(model)
        for tp in args.big_tp if name.startswith("big") else args.tp:
            print(f"{name} tp={tp} ...", file=sys.stderr)
            rows.extend(compare(name, model, tp, work, ids, reference, branches))
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    if not paths:
        raise UserError("no models")
    return 0


if __name__ == "__main__":
    run_cli(main)
