"""Streaming benchmark of the Hugging Face exporter (tools/bench.py export): memory and time against a copy.

A random nemotron-nas checkpoint in the published layout (exporters.hf.synthetic: bf16 shards + index,
block_configs) is written, then, each in a fresh child process whose own peak RSS is read
(runtime.bench.peak_memory):
  - a plain copy of the checkpoint's safetensors files (the I/O floor),
  - tools/export_model.py --hf (bf16 kept: the kernel copies each tensor in a second thread while
    exporters.hf.prefill_graph builds the graph with onnx-ir, without torch),
  - optionally --dtype float16 (tensors converted in row chunks).
The page cache is in the same state for every step: one untimed copy first reads the checkpoint in, and
before each step `sync` writes back what the step before left dirty. The copy and the exports then
alternate for `rounds` rounds (runtime.bench.peak_memory.alternate_with_copy), and each export is compared
with the copy of its own round.
Bounds (issue 10): peak RSS <= 1 GB + the largest single tensor; time within 2x of the copy. The export's
own split (graph building vs weight streaming, which overlap) and its CPU time (all threads) are reported.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from exporters.hf.safetensors_in import open_checkpoint
from runtime.bench.peak_memory import alternate_with_copy, measure

ROOT = Path(__file__).resolve().parents[2]
MB, GB = 1 << 20, 1 << 30
MULTS = [5.25, 1.0, 2.625, 1.3125, 0.5, 3.28125]

_WRITE = """
import sys
from runtime.bench.export import write_checkpoint
write_checkpoint(sys.argv[1], *map(int, sys.argv[2:]))
"""


@dataclass
class ExportStep:
    name: str
    seconds: float
    peak_bytes: int
    graph_seconds: float = 0.0
    weights_seconds: float = 0.0
    output_bytes: int = 0
    round: int = 0
    copy_seconds: float = 0.0  # the copy of the same round
    cpu_seconds: float = 0.0  # user + system CPU time of the step's process (all its threads)


@dataclass
class ExportBench:
    checkpoint_bytes: int
    largest_tensor_bytes: int
    layers: int
    hidden: int
    steps: list[ExportStep]

    @property
    def bound_bytes(self) -> int:
        return GB + self.largest_tensor_bytes

    def ratio(self, step: ExportStep) -> float:
        return step.seconds / (step.copy_seconds or step.seconds)

    def within(self, step: ExportStep) -> bool:
        return step.peak_bytes <= self.bound_bytes and self.ratio(step) <= 2.0

    def median_ratio(self, name: str) -> float:
        return statistics.median(self.ratio(s) for s in self.steps if s.name == name)

    def as_json(self) -> str:
        names = dict.fromkeys(s.name for s in self.steps if s.name != "copy")
        data = asdict(self) | {
            "bound_bytes": self.bound_bytes,
            "median_ratio": {n: self.median_ratio(n) for n in names},
        }
        return json.dumps(data, indent=1)

    def report(self) -> str:
        lines = [
            f"checkpoint: {self.checkpoint_bytes / 1e9:.2f} GB bf16 ({self.layers} layers, "
            f"hidden {self.hidden}); largest tensor {self.largest_tensor_bytes / MB:.0f} MB; "
            f"RSS bound {self.bound_bytes / MB:.0f} MB",
            f"{'round':<6}{'step':<13}{'seconds':>9}{'x copy':>8}{'CPU s':>7}{'peak RSS MB':>13}"
            f"{'graph s':>9}{'weights s':>11}  within bounds",
        ]
        for step in self.steps:
            ok = "" if step.name == "copy" else ("yes" if self.within(step) else "NO")
            lines.append(
                f"{step.round:<6}{step.name:<13}{step.seconds:>9.1f}{self.ratio(step):>8.2f}"
                f"{step.cpu_seconds:>7.1f}"
                f"{step.peak_bytes / MB:>13.0f}{step.graph_seconds:>9.1f}{step.weights_seconds:>11.1f}"
                f"  {ok}"
            )
        names = dict.fromkeys(s.name for s in self.steps if s.name != "copy")
        lines += [f"median x copy, {n}: {self.median_ratio(n):.2f}" for n in names]
        return "\n".join(lines)


def write_checkpoint(
    folder: str | Path, hidden: int, heads: int, layers: int, vocab: int, shards: int
) -> None:
    """Super-49B-like layers: attention (8 heads per KV head) on even layers only, ffn_mult cycling."""
    from exporters.hf.synthetic import LLAMA3_ROPE, deci_block, nemotron_config, write_nemotron  # noqa: PLC0415 (torch: only to write the benchmark's checkpoint)

    blocks = [deci_block(8 if i % 2 == 0 else "no_op", MULTS[i % len(MULTS)]) for i in range(layers)]
    config = nemotron_config(blocks, hidden=hidden, heads=heads, vocab=vocab, rope_scaling=LLAMA3_ROPE)
    write_nemotron(folder, config, shards=shards)


def build_checkpoint(folder: Path, hidden: int, heads: int, layers: int, vocab: int, shards: int) -> None:
    """write_checkpoint in a child process, so that torch stays out of the benchmark's own process (both
    streaming benchmarks start from this checkpoint)."""
    args = map(str, (folder, hidden, heads, layers, vocab, shards))
    subprocess.run([sys.executable, "-c", _WRITE, *args], check=True, cwd=ROOT)


def bench(
    work: Path,
    hidden: int = 2048,
    heads: int = 16,
    layers: int = 72,
    vocab: int = 32000,
    shards: int = 8,
    convert: bool = False,
    rounds: int = 2,
    log: Callable[[str], None] = print,
) -> ExportBench:
    checkpoint = work / "checkpoint"
    log(f"writing a nemotron-nas checkpoint: hidden {hidden}, {layers} layers, bf16 ...")
    build_checkpoint(checkpoint, hidden, heads, layers, vocab, shards)
    table = open_checkpoint(checkpoint)
    shards_files = sorted(checkpoint.glob("*.safetensors"))
    script = ROOT / "tools" / "export_model.py"
    runs = [("export_bf16", script, ["--hf", checkpoint, "-o"])]
    runs += [("export_fp16", script, ["--dtype", "float16", "--hf", checkpoint, "-o"])] if convert else []
    measured = [(name, partial(_export_step, name, target, args, work)) for name, target, args in runs]
    steps = []
    for one in alternate_with_copy(shards_files, work / "copy", rounds, measured, log):
        copy = ExportStep(
            "copy", one.copy.seconds, one.copy.peak_bytes, output_bytes=table.total_bytes, round=one.round,
            copy_seconds=one.copy.seconds, cpu_seconds=one.copy.cpu_seconds,
        )  # fmt: skip
        steps.append(copy)
        for step in one.steps:
            step.copy_seconds = one.copy.seconds
            steps.append(step)
    return ExportBench(table.total_bytes, table.largest_bytes, layers, hidden, steps)


def _export_step(name: str, target: str | Path, args: list, work: Path, round_: int) -> ExportStep:
    out = work / name / "model.onnx"
    run = measure(target, [*args, out])
    if run.code != 0:
        raise RuntimeError(f"{name} failed: {run.output[-800:]}")
    split = re.search(r"time: graph ([\d.]+) s, weights ([\d.]+) s", run.output)
    graph, weights = (float(split.group(1)), float(split.group(2))) if split else (0.0, 0.0)
    size = sum(p.stat().st_size for p in out.parent.iterdir())
    shutil.rmtree(out.parent)
    return ExportStep(
        name, run.seconds, run.peak_bytes, graph, weights, size, round_, cpu_seconds=run.cpu_seconds
    )
