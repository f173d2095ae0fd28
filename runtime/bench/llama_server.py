"""llama.cpp's llama-server as a peer in the serving benchmark (tools/bench.py serve --gguf).

`LlamaServer` starts one llama-server on a GGUF file, on 127.0.0.1 and a free port, with `parallel` slots
(`-np`, continuous batching) and `context_per_slot` tokens of KV cache per slot (`-c parallel *
context_per_slot`: without a unified KV cache llama-server splits `-c` between the slots), waits until its
/health answers 200, and stops it on exit (SIGTERM to its process group, SIGKILL after `stop_timeout`).
The process also gets SIGTERM when the process that started it dies (Linux PR_SET_PDEATHSIG), so a
benchmark killed outright leaves no server behind. Its output goes to `log` (a file).

llama-server is OpenAI-compatible: the benchmark talks to it exactly as to this project's server (the
streamed /v1/completions, temperature 0, `ignore_eos`, the usage chunk). Build it with `make llama-cpp`
(DESIGN 13; the binaries land in ~/.cache/ffn-fusion/llama-cpp-python-<version>/build/bin).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from passes.errors import UserError
from runtime.bench.serve import Target
from runtime.ports import free_port

HOW_TO_BUILD = (
    "`make llama-cpp` builds it (10-17 minutes on 2 cores) into "
    "~/.cache/ffn-fusion/llama-cpp-python-0.3.36/build/bin/llama-server"
)


def find_binary(given: str | Path | None) -> Path:
    """The llama-server to run: `given` (a path or a name on PATH), else `llama-server` on PATH."""
    name = str(given) if given else "llama-server"
    found = shutil.which(name) if os.sep not in name else (name if Path(name).is_file() else None)
    if not found:
        where = f"{given} is not an executable file" if given else "no llama-server on PATH"
        raise UserError(f"{where}: give --llama-server PATH; {HOW_TO_BUILD}")
    if not os.access(found, os.X_OK):
        raise UserError(f"{found} is not executable")
    return Path(found)


def gguf_file_type(path: Path) -> str:
    """A GGUF's weight type as llama.cpp names it (`f32`, `f16`, `bf16`, `q8_0`, ...), or its file stem
    when the file says none (or the gguf package is missing)."""
    try:
        import gguf  # noqa: PLC0415 (the export extras; only to name the file in the report)

        reader = gguf.GGUFReader(path)
        value = reader.fields["general.file_type"].contents()
        name = gguf.LlamaFileType(int(value)).name
    except (ImportError, KeyError, ValueError):
        return path.stem
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def check_gguf(path: Path) -> None:
    if not path.is_file():
        raise UserError(f"{path} is not a file (a .gguf model for llama-server)")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF')")


def labels_for(paths: Sequence[Path]) -> list[str]:
    """`llama.cpp <type>` per GGUF; the file stem is added where two files have the same type."""
    types = [gguf_file_type(p) for p in paths]
    return [f"llama.cpp {t}" if types.count(t) == 1 else f"llama.cpp {t} ({p.stem})"
            for t, p in zip(types, paths, strict=True)]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class LlamaServer:
    binary: Path
    gguf: Path
    parallel: int = 8
    context_per_slot: int = 1024
    alias: str = ""
    log: Path | None = None
    threads: int | None = None
    start_timeout: float = 300.0
    stop_timeout: float = 15.0
    extra_args: Sequence[str] = ()
    port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)
    command: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __post_init__(self) -> None:
        self.alias = self.alias or self.gguf.stem

    def start(self) -> LlamaServer:
        check_gguf(self.gguf)
        self.port = self.port or free_port()
        self.command = [
            str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-np", str(self.parallel), "-c", str(self.parallel * self.context_per_slot),
            "--alias", self.alias, "--no-webui",
            *(["-t", str(self.threads)] if self.threads else []),
            *self.extra_args,
        ]
        out = self.log.open("ab") if self.log else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            if self.log:
                out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        import httpx  # noqa: PLC0415 (the client side of the benchmark: the test extras, as runtime.bench.serve)

        deadline = time.monotonic() + self.start_timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise UserError(f"llama-server exited with status {code} while loading {self.gguf}"
                                + self._log_tail())
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise UserError(f"llama-server did not answer /health within {self.start_timeout:.0f} s"
                                + self._log_tail())
            time.sleep(0.2)  # polling a process that gives no other signal of readiness

    def _log_tail(self, lines: int = 8) -> str:
        if not self.log or not self.log.is_file():
            return ""
        tail = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f" (log {self.log}):\n" + "\n".join(tail)

    def stop(self) -> int | None:
        """Stop the server (and anything it started); its exit status, None when it never started."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def version(binary: Path) -> str:
    """`llama-server --version`'s first line (e.g. `version: 1 (abc123)`), or "" when it says nothing."""
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = (result.stdout + result.stderr).strip().splitlines()
    return next((line.strip() for line in lines if line.startswith("version")), lines[0] if lines else "")


def start_peers(
    stack: contextlib.ExitStack,
    binary: Path,
    ggufs: Sequence[Path],
    parallel: int,
    log_dir: Path,
    context_per_slot: int = 1024,
    threads: int | None = None,
    log=print,
) -> list:
    """Start a LlamaServer per GGUF (`parallel` slots each) inside `stack`, which stops them; returns their
    benchmark targets (runtime.bench.serve.Target), labelled `llama.cpp <type>`."""
    about = version(binary)
    targets = []
    for index, (label, path) in enumerate(zip(labels_for(ggufs), ggufs, strict=True)):
        server = LlamaServer(binary, path, parallel=parallel, context_per_slot=context_per_slot,
                             threads=threads, log=log_dir / f"llama-server-{index}.log")
        log(f"starting llama-server on {path} ({label}, {parallel} slots)")
        stack.enter_context(server)
        engine = f"llama-server {about}".strip() + f": {path.name}, " + " ".join(server.command[5:])
        targets.append(Target(label, server.url, server.alias, engine))
    return targets
