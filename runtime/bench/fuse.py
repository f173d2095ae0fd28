"""The scale benchmark of the fusion pass (issue 13), run by tools/bench.py fuse.

For each shape it builds an FFN-only synthetic model with external data, then measures side by side, each
step in a fresh child process (runtime.bench.peak_memory: wall time and the child's own peak RSS):

- copying the model's files (the I/O floor the fusion is held to: at most 1.2x its time), and
  tools/fuse_onnx.py without validation, "fold" and "last" (bound: 256 MB peak RSS, whatever the group
  size; the time is the tool's own, from loading to the written output, without Python's imports), in
  `repeat` rounds that alternate them, plus a last copy. Each is reported as its best round (what the
  other processes on a shared machine did not add) against the best copy, and as the median against
  the copies' median;
- tools/fuse_onnx.py with validation, "fold" (bound: 512 MB);
- optionally FP8 quantization (scales given: calibration is an ONNX Runtime run of the whole model),
  tensor-parallel sharding at TP 8 of the unfused model, and tools/analyze.py on it (block by block above
  3 GB; --norm auto: the plan fused with both norm modes, each model's logits computed block by block
  too) (bound: 512 MB);
- optionally an FP8 TensorRT-RTX engine build (reported, no bound).

Outputs are deleted after each step, so the disk holds about three copies of the model at most. Before each
timed step the file system is synced: the previous step's dirty pages would otherwise be flushed (or
throttle the writer) during the next one, whichever it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from passes.io.data_files import data_files
from passes.io.model_io import load_model, save_model
from passes.patterns.linear import find_linears
from passes.quant.calibrate import ActivationScales
from passes.quant.fp8 import quantize_fp8
from runtime.bench.peak_memory import Measured, measure, timed_copy

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
FUSE_RSS_BOUND = 256 * MB
VALIDATE_RSS_BOUND = 512 * MB
STAGE_RSS_BOUND = 512 * MB
TIME_BOUND = 1.2  # fusing, times the copy

# The two shapes of issue 13: hidden, FFN width, blocks, blocks per group, dtype.
SHAPES = {
    "fp32-24x2048x8192-groups-of-4": (2048, 8192, 24, 4, "float32"),
    "fp16-3x8192x28672-one-group": (8192, 28672, 3, 3, "float16"),
}

BUILD = """
import sys
from exporters import synthetic
hidden, ffn, blocks, dtype, path = sys.argv[1:]
blocks = [(False, int(ffn))] * int(blocks)
spec = synthetic.SyntheticSpec(hidden=int(hidden), vocab=256, blocks=blocks, dtype=dtype)
synthetic.build_synthetic(spec, path, external=True)
"""


@dataclass
class FuseStep:
    name: str
    seconds: float  # the work: for the fuse steps, load to written output as fuse_onnx.py times it
    peak_bytes: int
    vs_copy: float
    bound_bytes: int | None = None
    time_bound: float | None = None
    total_seconds: float | None = None  # with Python's imports (seconds under load on a shared machine)
    samples: list[float] | None = None  # every round's seconds; `seconds` is the best
    median_vs_copy: float | None = None  # median over the rounds, against the copies' median
    paired_vs_copy: float | None = None  # median over the rounds of the ratio to that round's copies

    @property
    def ok(self) -> bool:
        memory = self.bound_bytes is None or self.peak_bytes <= self.bound_bytes
        return memory and (self.time_bound is None or self.vs_copy <= self.time_bound)


@dataclass
class ShapeResult:
    shape: str
    model_bytes: int
    group_weight_bytes: int
    steps: list[FuseStep] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after the fusion steps
    # Bytes the kernel reclaimed in the allocating processes' own path during the timed steps (None: no
    # /proc/vmstat). Above zero, memory ran short and every write paid for it (docs/scale.md, ninth pass).
    direct_reclaim_bytes: int | None = None


def _checked(measured: Measured, what: str) -> Measured:
    if measured.code != 0:
        raise RuntimeError(f"{what} failed ({measured.code}): {measured.output[-800:]}")
    return measured


def _files(model: Path) -> list[Path]:
    return [model, *data_files(model)]


def _size(model: Path) -> int:
    return sum(p.stat().st_size for p in _files(model) if p.exists())


def _remove(*paths: Path) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            for file in _files(path):
                file.unlink(missing_ok=True)


def bench_shape(
    name: str,
    spec: tuple,
    work: Path,
    stages: bool,
    log=print,
    engine: bool = False,
    repeat: int = 1,
    against: Path | None = None,
) -> ShapeResult:
    hidden, ffn, blocks, group, dtype = spec
    folder = work / name
    folder.mkdir(parents=True)
    model = folder / "model.onnx"
    log(f"{name}: building {blocks} FFNs of {hidden} x {ffn} ({dtype}, external data) ...")
    build = [sys.executable, "-c", BUILD, *map(str, (hidden, ffn, blocks, dtype, model))]
    subprocess.run(build, check=True, cwd=ROOT)
    groups = [[i, min(i + group, blocks) - 1] for i in range(0, blocks, group)]
    plans = {mode: folder / f"plan_{mode}.json" for mode in ("fold", "last")}
    for mode, plan in plans.items():
        plan.write_text(json.dumps({"groups": [g for g in groups if g[1] > g[0]], "norm": mode}))
    itemsize = 4 if dtype == "float32" else 2
    result = ShapeResult(name, _size(model), 3 * hidden * ffn * itemsize * group)
    start_load, start_reclaim = os.getloadavg()[0], direct_reclaim_pages()
    out = ["-o", folder / "f.onnx"]
    timed = {}  # "fold" rescales (and in half precision converts) every gate/up row; "last" only copies
    for mode in ("fold", "last"):
        args = [model, plans[mode], "--no-validate", *out]
        timed[f"fuse ({mode})"] = Fusion(ROOT, args)
        if against is not None:  # the same fusion by another checkout, right after or before ours
            timed[f"  {mode} @{against.name}"] = Fusion(against, args)
    samples: dict[str, list[tuple[float, Measured]]] = {"copy": [], **{step: [] for step in timed}}
    for round_ in range(repeat):  # rounds alternate copy and fusions, so that all see the same load
        samples["copy"].append(_copy(name, model, folder, log))
        steps = list(timed) if round_ % 2 == 0 else _swapped_pairs(list(timed), against)
        for step in steps:
            log(f"{name}: {step.strip()} (round {round_ + 1} of {repeat}) ...")
            samples[step].append(_fuse(timed[step], folder, step))
    samples["copy"].append(_copy(name, model, folder, log))
    result.load = (start_load, os.getloadavg()[0])
    end_reclaim = direct_reclaim_pages()
    if start_reclaim is not None and end_reclaim is not None:
        result.direct_reclaim_bytes = (end_reclaim - start_reclaim) * os.sysconf("SC_PAGE_SIZE")
    copies = [seconds for seconds, _ in samples["copy"]]
    copy = min(copies)  # best of each: what interference did not add
    copy_median = statistics.median(copies)
    for step, runs in samples.items():
        ours = step.startswith("fuse")  # the bounds hold for this checkout's fusions
        bound, time_bound = (FUSE_RSS_BOUND, TIME_BOUND) if ours else (None, None)
        seconds, measured = min(runs, key=lambda run: run[0])
        every = [run[0] for run in runs]
        peak = max(m.peak_bytes for _, m in runs)
        step_result = FuseStep(
            step, seconds, peak, seconds / copy, bound, time_bound, measured.seconds, every
        )
        step_result.median_vs_copy = statistics.median(every) / copy_median
        if step != "copy":
            step_result.paired_vs_copy = paired_ratio(every, copies)
        result.steps.append(step_result)
    log(f"{name}: fuse + validation ...")
    work, measured = _fuse(Fusion(ROOT, [model, plans["fold"], *out]), folder, "fuse + validation")
    validation = FuseStep("fuse + validation", work, measured.peak_bytes, work / copy, VALIDATE_RSS_BOUND)
    validation.total_seconds = measured.seconds
    result.steps.append(validation)
    if stages:
        for step, target, args in (
            ("FP8 quantization", "runtime.bench.fuse:fp8_step", [model, folder / "fp8.onnx"]),
            (
                "TP 8 sharding",
                ROOT / "tools" / "shard_tp.py",
                [model, "--tp", 8, "--out", folder / "tp8", "--quiet"],
            ),
            (
                "analysis",
                ROOT / "tools" / "analyze.py",
                [model, "--out", folder / "analysis", "--quiet"],  # --norm auto: 2 trial fusions
            ),
        ):
            log(f"{name}: {step} ...")
            measured = _checked(measure(target, args), step)
            _remove(folder / "fp8.onnx", folder / "tp8", folder / "analysis")
            result.steps.append(
                FuseStep(
                    step,
                    measured.seconds,
                    measured.peak_bytes,
                    measured.seconds / copy,
                    STAGE_RSS_BOUND,
                )
            )
    if engine:
        log(f"{name}: FP8 engine build (TensorRT-RTX) ...")
        scales = _unit_scales(model, folder / "scales.json")
        args = [model, "--fp8", "--scales", scales, "--out", folder / "engines"]
        measured = _checked(measure(ROOT / "tools" / "build_engines.py", args), "engine build")
        result.steps.append(
            FuseStep("FP8 engine build", measured.seconds, measured.peak_bytes, measured.seconds / copy)
        )
    _remove(folder)
    return result


def direct_reclaim_pages(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """Pages reclaimed so far by processes that had to free memory before they could allocate it
    (`pgsteal_direct`), or None where the kernel does not say."""
    try:
        text = vmstat.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "pgsteal_direct":
            return int(value)
    return None


def paired_ratio(seconds: list[float], copies: list[float]) -> float:
    """The median over the rounds of a step's seconds over the mean of the two copies that bracket its round
    (the round's own, first, and the next round's; `copies` has one more than `seconds`). On a shared host
    whose speed drifts by several times within minutes, each ratio compares runs a few seconds apart, where
    "best against best" may pair a fusion and a copy from different minutes."""
    if len(copies) != len(seconds) + 1:
        raise ValueError(f"{len(seconds)} rounds need {len(seconds) + 1} copies, got {len(copies)}")
    around = [(before + after) / 2 for before, after in zip(copies, copies[1:], strict=False)]
    return statistics.median(s / copy for s, copy in zip(seconds, around, strict=True))


def _copy(name: str, model: Path, folder: Path, log) -> tuple[float, Measured]:
    log(f"{name}: copying the files ...")
    os.sync()
    copy = _checked(timed_copy(_files(model), folder / "copy"), "copy")
    _remove(folder / "copy")
    return copy.seconds, copy


@dataclass(frozen=True)
class Fusion:
    """tools/fuse_onnx.py of the checkout at `root`, with `args`. The child runs in `root` with it on
    PYTHONPATH: from anywhere else the editable install of this checkout's .venv would import this
    checkout's `passes` whatever script runs."""

    root: Path
    args: list

    def run(self) -> Measured:
        tool = self.root / "tools" / "fuse_onnx.py"
        return measure(tool, self.args, env={"PYTHONPATH": str(self.root)}, cwd=self.root)


def _swapped_pairs(steps: list[str], against: Path | None) -> list[str]:
    """Every other round, the other checkout's fusion goes before ours (the first of a pair runs on a
    freshly synced disk)."""
    if against is None:
        return steps
    return [step for i in range(0, len(steps), 2) for step in reversed(steps[i : i + 2])]


def imports_from(root: Path) -> Path | None:
    """The `passes` package a fusion run in checkout `root` imports (None: none imports; bench_fuse
    --against checks it)."""
    probe = "import passes; print(list(passes.__path__)[0])"
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=root)
    return Path(run.stdout.strip()) if run.returncode == 0 else None


def _fuse(fusion: Fusion, folder: Path, step: str) -> tuple[float, Measured]:
    os.sync()
    measured = _checked(fusion.run(), step.strip())
    _remove(folder / "f.onnx")
    return _work_seconds(measured), measured


def _unit_scales(model: Path, path: Path) -> Path:
    """An FP8 scales file with scale 1 for every linear input (calibration is a whole-model run)."""

    names = {linear.activation.name for linear in find_linears(load_model(model).graph)}
    ActivationScales({name: 1.0 for name in sorted(names)}).save(path)
    return path


def _work_seconds(measured: Measured) -> float:
    """fuse_onnx.py's own time ("wrote ... in S s": load, fuse, save, validate), without the interpreter's
    imports, which take seconds of their own on a loaded machine and do not grow with the model."""
    found = re.findall(r"^wrote .* in ([0-9.]+) s$", measured.output, re.MULTILINE)
    return float(found[-1]) if found else measured.seconds


def fp8_step() -> int:
    """FP8 quantization of sys.argv[1] into sys.argv[2], with unit activation scales (no calibration)."""

    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    model = load_model(source)
    scales = {linear.activation.name: 1.0 for linear in find_linears(model.graph)}
    quantize_fp8(model, scales)
    save_model(model, target, external=True)
    return 0


def report(results: list[ShapeResult]) -> str:
    lines = []
    for result in results:
        lines.append(
            f"{result.shape}: model {result.model_bytes / 1e9:.2f} GB, "
            f"largest group's weights {result.group_weight_bytes / MB:.0f} MB, "
            f"load average {result.load[0]:.1f} -> {result.load[1]:.1f}{_reclaim_note(result)}; "
            "x copy: best against best; paired x: median of each round's ratio to the copies around it"
        )
        lines.append(
            f"  {'step':<20}{'seconds':>9}{'x copy':>8}{'median x':>10}{'paired x':>10}{'peak RSS MB':>13}"
            f"{'bound':>16}  ok"
            "  (with imports)"
        )
        for step in result.steps:
            bound = []
            if step.bound_bytes is not None:
                bound.append(f"{step.bound_bytes / MB:.0f} MB")
            if step.time_bound is not None:
                bound.append(f"{step.time_bound}x")
            lines.append(
                f"  {step.name:<20}{step.seconds:>9.1f}{step.vs_copy:>8.2f}"
                + _ratio_column(step.median_vs_copy)
                + _ratio_column(step.paired_vs_copy)
                + f"{step.peak_bytes / MB:>13.0f}"
                f"{', '.join(bound):>16}  {'yes' if step.ok else 'NO ':<3}"
                + (f" ({step.total_seconds:.1f} s)" if step.total_seconds is not None else "")
            )
    return "\n".join(lines)


def _reclaim_note(result: ShapeResult) -> str:
    if not result.direct_reclaim_bytes:
        return ""
    return (
        f", direct reclaim {result.direct_reclaim_bytes / MB:.0f} MB (memory ran short: the times are "
        "suspect; drop other large files from the page cache and rerun)"
    )


def _ratio_column(ratio: float | None) -> str:
    return f"{ratio:>10.2f}" if ratio is not None else f"{'':>10}"


def as_json(results: list[ShapeResult]) -> str:
    return json.dumps(
        [asdict(r) | {"steps": [asdict(s) | {"ok": s.ok} for s in r.steps]} for r in results], indent=1
    )
