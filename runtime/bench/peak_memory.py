"""Wall time, CPU time and peak resident memory of one step, run in a fresh Python process (benchmarks use
this), and the alternating copy / step rounds the streaming benchmarks compare against.

The peak is the child's own VmHWM from /proc/self/status, read just before it exits. ru_maxrss from wait4
is no good here: Linux carries the parent's resident size at fork across exec into the child. The CPU time is
the child's own (user + system of all its threads, and of the processes it waited for), counted over the step
as the wall time is, without the interpreter's start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

# argv[1]: "module:function" (called with sys.argv set) or a script path (run as __main__); argv[2]: the
# JSON report path; the rest: the step's own arguments.
_CHILD = """
import importlib, json, resource, runpy, sys, time
target, report = sys.argv[1], sys.argv[2]
sys.argv = [target] + sys.argv[3:]
start, cpu, code = time.perf_counter(), time.process_time(), 0
try:
    if ":" in target:
        module, func = target.split(":")
        result = getattr(importlib.import_module(module), func)()
        code = result if isinstance(result, int) else 0
    else:
        runpy.run_path(target, run_name="__main__")
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
except Exception as exc:  # report, do not hide
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    code = 1
seconds = time.perf_counter() - start
children = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = time.process_time() - cpu + children.ru_utime + children.ru_stime
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
json.dump({"code": code, "seconds": seconds, "cpu_seconds": cpu, "peak_kib": peak}, open(report, "w"))
"""


@dataclass(frozen=True)
class Measured:
    code: int  # the step's exit code
    seconds: float  # the step itself, without interpreter start-up
    peak_bytes: int  # the child process's peak RSS
    output: str  # its stdout and stderr
    cpu_seconds: float = 0.0  # the step's CPU time: user + system, all threads (and waited-for children)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    @property
    def last_line(self) -> str:
        return (self.output.strip().splitlines() or [""])[-1][:160]


def measure(
    target: str | Path,
    args: Sequence[object] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Measured:
    """Run `target` ("module:function" or a script path) with `args` in a fresh interpreter (in `cwd`, which
    comes first on its import path)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report = Path(f.name)
    try:
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, str(target), str(report), *map(str, args)],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        data = json.loads(report.read_text()) if report.stat().st_size else None
    finally:
        report.unlink(missing_ok=True)
    output = run.stdout + run.stderr
    if data is None:  # the child died before reporting (killed, or the interpreter failed)
        return Measured(run.returncode or 1, 0.0, 0, output)
    seconds, cpu = float(data["seconds"]), float(data["cpu_seconds"])
    return Measured(int(data["code"]), seconds, int(data["peak_kib"]) * 1024, output, cpu)


def timed_copy(files: Sequence[Path], target: Path) -> Measured:
    """The baseline: copying the files into `target` (a folder), measured the same way."""
    target.mkdir(parents=True, exist_ok=True)
    script = target.parent / f"{target.name}_copy.py"
    script.write_text("import shutil, sys\nfor p in sys.argv[2:]:\n    shutil.copy(p, sys.argv[1])\n")
    try:
        return measure(script, [target, *files])
    finally:
        script.unlink()


@dataclass(frozen=True)
class CopyRound(Generic[T]):
    """One round of alternate_with_copy: the copy, then what each step returned."""

    round: int
    copy: Measured
    steps: list[T]


def alternate_with_copy(
    files: Sequence[Path],
    target: Path,
    rounds: int,
    steps: Sequence[tuple[str, Callable[[int], T]]],
    log: Callable[[str], None] = print,
) -> list[CopyRound[T]]:
    """The streaming benchmarks' rounds: one untimed copy of `files` into `target` (it reads them into the
    page cache), then per round the timed copy (timed_copy; `target` removed after it) and each step
    (`step(round)`, which measures itself and removes what it wrote), in that order. Before each, os.sync()
    writes back what the one before left dirty, so that none pays for another's writeback, and since the
    copy and the steps alternate, a change in the machine's load falls on both sides of a round's ratio."""
    timed_copy(files, target)
    shutil.rmtree(target)
    done = []
    for round_ in range(1, rounds + 1):
        log(f"round {round_}: copy ...")
        os.sync()
        copied = timed_copy(files, target)
        shutil.rmtree(target)
        results = []
        for name, step in steps:
            log(f"round {round_}: {name} ...")
            os.sync()
            results.append(step(round_))
        done.append(CopyRound(round_, copied, results))
    return done
