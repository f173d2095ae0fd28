"""Streaming benchmark of the checkpoint writer (tools/bench.py export-checkpoint): time and peak memory of
tools/export_checkpoint.py against a plain copy of the same weights, and of its GGUF writer (--gguf).

Setup (untimed): runtime.bench.export's random Nemotron-NAS checkpoint (bf16 shards, attention on even
layers), exported by export_model.py --hf (bf16) and fused with every pair [2k, 2k + 1] of the first
`groups` pairs (an attention layer and the attention-free layer after it), without validation. Then, for
`rounds` rounds (runtime.bench.peak_memory.alternate_with_copy, as runtime.bench.export), each step in a
fresh child process whose own peak RSS and CPU time are read, with `sync` before each so that none pays for
the writeback of the one before:
  - copy: the fused graph's data file copied (the bytes the checkpoint holds, the I/O floor),
  - export: tools/export_checkpoint.py of the fused graph (bf16 kept: kernel copies only);
  - gguf DTYPE (when asked for): tools/export_checkpoint.py --gguf --dtype DTYPE of the same graph (f32
    writes twice the bytes of the bf16 weights, q8_0 quantizes them: CPU work a copy does not do; bf16
    copies them except Q and K, whose rows are permuted).
Bounds (issue 36; issue 47 for the GGUF writer): time at most 1.2x the copy's, peak RSS at most 256 MB,
whatever the model size.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from runtime.bench.export import build_checkpoint
from runtime.bench.peak_memory import alternate_with_copy, measure

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
PEAK_BOUND = 256 * MB
TIME_BOUND = 1.2

_PREPARE = """
import sys
from pathlib import Path
from exporters.hf.checkpoint import export_hf
from passes.pipeline import fuse_file
from passes.plan import parse_plan
checkpoint, work, groups = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
export_hf(checkpoint, work / "onnx" / "model.onnx")
plan = parse_plan({"groups": [[2 * k, 2 * k + 1] for k in range(groups)], "norm": "last"})
fuse_file(work / "onnx" / "model.onnx", plan, work / "fused" / "model.onnx", validate_output=False)
"""


@dataclass
class CheckpointStep:
    name: str
    round: int
    seconds: float
    cpu_seconds: float
    peak_bytes: int
    output_bytes: int


@dataclass
class CheckpointBench:
    data_bytes: int
    layers: int
    hidden: int
    groups: int
    steps: list[CheckpointStep]

    def ratios(self, name: str = "export") -> list[float]:
        copies = {s.round: s.seconds for s in self.steps if s.name == "copy"}
        return [s.seconds / copies[s.round] for s in self.steps if s.name == name]

    @property
    def step_names(self) -> list[str]:
        return list(dict.fromkeys(s.name for s in self.steps if s.name != "copy"))

    def as_json(self) -> str:
        ratios = {name: self.ratios(name) for name in self.step_names}
        return json.dumps({**asdict(self), "ratios": ratios}, indent=1)

    def table(self) -> str:
        lines = [
            f"fused graph: {self.data_bytes / 2**30:.2f} GiB of weights, hidden {self.hidden}, {self.layers} "
            f"layers, {self.groups} fused pairs",
            f"{'step':<10}{'round':>6}{'seconds':>9}{'x copy':>8}{'CPU s':>7}{'peak MiB':>10}{'out GiB':>9}"
            "  bounds",
        ]
        copies = {s.round: s.seconds for s in self.steps if s.name == "copy"}
        for s in self.steps:
            ratio = s.seconds / copies[s.round]
            ok = ""
            if s.name != "copy":
                ok = "ok" if ratio <= TIME_BOUND and s.peak_bytes <= PEAK_BOUND else "OVER"
            lines.append(
                f"{s.name:<10}{s.round:>6}{s.seconds:>9.2f}{ratio:>8.2f}{s.cpu_seconds:>7.1f}"
                f"{s.peak_bytes / MB:>10.0f}{s.output_bytes / 2**30:>9.2f}  {ok}"
            )
        for name in self.step_names:
            lines.append(f"median x copy, {name}: {statistics.median(self.ratios(name)):.2f}")
        return "\n".join(lines)


def bench(
    work: Path,
    hidden: int = 2048,
    heads: int = 16,
    layers: int = 72,
    vocab: int = 32000,
    shards: int = 8,
    groups: int = 8,
    rounds: int = 2,
    log: Callable[[str], None] = print,
    gguf: Sequence[str] = (),
    checkpoint_step: bool = True,
) -> CheckpointBench:
    """`gguf`: the GGUF dtypes to time as well (tools/export_checkpoint.py --gguf); `checkpoint_step`:
    time the checkpoint writer too."""
    checkpoint = work / "checkpoint"
    log(f"writing a nemotron-nas checkpoint: hidden {hidden}, {layers} layers, bf16 ...")
    build_checkpoint(checkpoint, hidden, heads, layers, vocab, shards)
    log(f"exporting it to ONNX and fusing {groups} pairs (untimed) ...")
    subprocess.run([sys.executable, "-c", _PREPARE, str(checkpoint), str(work), str(groups)], check=True,
                   cwd=ROOT)
    fused = work / "fused" / "model.onnx"
    data = [p for p in fused.parent.iterdir() if p.name != fused.name]
    data_bytes = sum(p.stat().st_size for p in data)
    writers = [("export_checkpoint", partial(_export_step, fused, checkpoint, work / "out"))]
    writers = writers if checkpoint_step else []
    writers += [(f"gguf {d}", partial(_gguf_step, fused, checkpoint, work / "out.gguf", d)) for d in gguf]
    steps = []
    for one in alternate_with_copy(data, work / "copy", rounds, writers, log):
        c = one.copy
        steps.append(CheckpointStep("copy", one.round, c.seconds, c.cpu_seconds, c.peak_bytes, data_bytes))
        steps += one.steps
    return CheckpointBench(data_bytes, layers, hidden, groups, steps)


def _export_step(fused: Path, checkpoint: Path, out: Path, round_: int) -> CheckpointStep:
    run = measure(ROOT / "tools" / "export_checkpoint.py", [fused, "--source", checkpoint, "-o", out])
    if run.code != 0:
        raise RuntimeError(f"export_checkpoint failed: {run.output[-800:]}")
    size = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return CheckpointStep("export", round_, run.seconds, run.cpu_seconds, run.peak_bytes, size)


def _gguf_step(fused: Path, checkpoint: Path, out: Path, dtype: str, round_: int) -> CheckpointStep:
    args = [fused, "--source", checkpoint, "--gguf", "--dtype", dtype, "-o", out]
    run = measure(ROOT / "tools" / "export_checkpoint.py", args)
    if run.code != 0:
        raise RuntimeError(f"export_checkpoint --gguf failed: {run.output[-800:]}")
    size = out.stat().st_size
    out.unlink()
    return CheckpointStep(f"gguf {dtype}", round_, run.seconds, run.cpu_seconds, run.peak_bytes, size)
