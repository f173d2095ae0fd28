"""tools/bench.py serve --gguf: llama.cpp's llama-server measured beside this project's server in one run
(runtime/bench/llama_server.py). The tests that run llama-server need `make llama-cpp`'s build and skip
without it (they never compile); the argument checks run everywhere."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from passes.errors import UserError
from runtime.bench.llama_server import LlamaServer
from runtime.serve import loading
from runtime.serve.server import ServerThread
from tests import llama_cpp
from tests import serve_fixtures as sf

ROOT = Path(__file__).resolve().parents[2]
BIN = llama_cpp.binaries()
needs_build = pytest.mark.skipif(BIN is None, reason="llama.cpp is not built: `make llama-cpp` (15 minutes)")


def _main(argv: list[str]) -> int:
    """tools/bench.py serve's main() in this process (its argument checks raise UserError)."""
    return runpy.run_path(str(ROOT / "tools" / "bench.py"), run_name="bench_tool")["main"](["serve", *argv])


def _servers_on(gguf: Path) -> list[psutil.Process]:
    """The llama-server processes running on `gguf` (the test's own file: no other job's server)."""
    return [p for p in psutil.process_iter(["cmdline"])  # unreadable processes have cmdline None
            if str(gguf) in (p.info["cmdline"] or []) and p.info["cmdline"][0].endswith("llama-server")]


def test_gguf_arguments_are_checked_before_anything_starts(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    text = tmp_path / "model.txt"
    text.write_text("not a model")
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on PATH
    out = tmp_path / "never"
    for args, message in [
        ([], "give one or two server URLs, or --gguf"),
        (["--gguf", str(tmp_path / "missing.gguf")], "is not a file"),
        (["--gguf", str(text)], "is not a GGUF file"),
        (["--gguf", str(fake)], "no llama-server on PATH: give --llama-server PATH; `make llama-cpp`"),
        (["--gguf", str(fake), "--llama-server", str(tmp_path / "nope")], "is not an executable file"),
        (["--gguf", str(fake), "--llama-context", "0"], "--llama-context"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            _main([*args, "--out", str(out)])
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return llama_cpp.tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@needs_build
def test_bench_serve_measures_llama_server_beside_our_server(tiny_gguf, tool, tmp_path) -> None:
    out = tmp_path / "bench"
    with ServerThread(loading.load(sf.tiny_folder(tmp_path, "decode"))) as ours:
        result = tool(
            "bench", "serve", ours.url, "--labels", "onnx", "--gguf", tiny_gguf,
            "--llama-server", BIN / "llama-server", "--llama-context", "256",
            "--concurrency", "1", "3", "--requests", "6", "--max-tokens", "8", "--prompt-words", "12",
            "--rounds", "2", "--warmup", "1", "--out", out, check=True, timeout=600,
        )  # fmt: skip
    data = json.loads((out / "bench_serve.json").read_text())
    assert [t["label"] for t in data["targets"]] == ["onnx", "llama.cpp f32"]
    engine = data["targets"][1]["engine"]
    assert engine.startswith("llama-server version") and "tiny.gguf, " in engine and "-np 3 -c 768" in engine
    assert data["targets"][1]["model"] == "tiny"  # the alias llama-server lists
    assert [(r["concurrency"], r["label"]) for r in data["results"]] == [
        (1, "onnx"), (1, "llama.cpp f32"), (3, "onnx"), (3, "llama.cpp f32"),
    ]  # fmt: skip
    for r in data["results"]:  # llama-server honours ignore_eos and reports usage in the stream
        assert r["failed"] == 0 and r["errors"] == [] and r["output_tokens"] == 6 * 8, r
    assert [(r["label"], r["concurrency"]) for r in data["throughput_ratio"]] == [
        ("llama.cpp f32", 1), ("llama.cpp f32", 3),
    ]  # fmt: skip
    assert len(data["load_average"]) == 2
    markdown = (out / "bench_serve.md").read_text()
    assert "| 3 | llama.cpp f32 |" in markdown
    assert "llama.cpp f32 / onnx output throughput" in markdown
    assert "starting llama-server on" in result.stderr
    assert (out / "llama-server-0.log").stat().st_size > 0
    assert not _servers_on(tiny_gguf)  # stopped at the end


@needs_build
def test_llama_server_is_stopped_when_the_benchmark_fails(tiny_gguf, tool, tmp_path) -> None:
    """A target that does not answer ends the run (exit 2) after llama-server started: it is stopped."""
    result = tool(
        "bench", "serve", "http://127.0.0.1:9", "--gguf", tiny_gguf, "--llama-server", BIN / "llama-server",
        "--llama-context", "256", "--concurrency", "1", "--requests", "2", "--out", tmp_path / "bench",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 2 and "cannot list the models of http://127.0.0.1:9" in result.stderr
    assert "starting llama-server on" in result.stderr and "Traceback" not in result.stderr
    assert not _servers_on(tiny_gguf)


@needs_build
def test_llama_server_that_cannot_load_is_reported_with_its_log(tmp_path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    server = LlamaServer(BIN / "llama-server", broken, parallel=1, context_per_slot=64, log=tmp_path / "log")
    with pytest.raises(UserError, match=r"llama-server exited with status \d+ while loading .*broken.gguf"):
        server.start()
    assert server.process is None and (tmp_path / "log").stat().st_size > 0


@needs_build
def test_llama_server_dies_with_the_process_that_started_it(tiny_gguf, tmp_path) -> None:
    """SIGKILL of the benchmark (no cleanup runs) still stops its llama-server: PR_SET_PDEATHSIG."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from runtime.bench.llama_server import LlamaServer\n"
        f"s = LlamaServer(Path({str(BIN / 'llama-server')!r}), Path({str(tiny_gguf)!r}), parallel=1,\n"
        "                context_per_slot=128, log=Path(sys.argv[1])).start()\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "log")], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running()
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    child.wait(timeout=30)  # raises psutil.TimeoutExpired if it outlives its parent
