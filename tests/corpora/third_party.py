"""A corpus of real third-party exports of SmolLM2-135M, for the tests of every stage (issue 9).

Each entry is one exporter's graph of the same model: SmolLM2 saved as a Hugging Face folder
(exporters/hf/folder.py) with attention dropped from blocks 13-22 the way a Nemotron-NAS model has it
(design §3b: no attention and no input norm there). The folder stores those layers' o_proj as zeros, so
the folder itself, loaded by transformers, is the exact torch reference of every entry.

    entry            exporter                                                   attention dropped
    optimum          optimum-cli export onnx --task text-generation-with-past   by graph surgery
    optimum-nopast   optimum-cli export onnx --task text-generation             by graph surgery
    genai-fp32       python -m onnxruntime_genai.models.builder -p fp32 -e cpu  by graph surgery
    genai-int4       the same with -p int4 (MatMulNBits)                        by graph surgery
    torchscript-17   torch.onnx.export(dynamo=False, opset 17), transformers 4.57  by graph surgery
    ort-optimizer    onnxruntime.transformers.optimizer (gpt2) on dynamo-18:    SkipSimplifiedLayerNorm
    dynamo-18        torch.onnx.export(dynamo=True, opset 18)                   in the model (export)
    dynamo-23        the same at opset 23                                       in the model (export)

The surgery (`drop_attention`) uses the model map: the attention sub-block's residual add is bypassed
(for Skip*Normalization chains the FFN's norm weight moves onto the preceding SkipSimplifiedLayerNorm),
its KV-cache inputs and outputs are removed, and the dead nodes go. GenAI's genai_config.json stays as the
builder wrote it (30 layers): onnxruntime-genai >= 0.18 finds the cache layers by input name, at
non-sequential indices too (tests/corpora/test_third_party.py runs its generator on the folder).

Optimum needs transformers < 4.58 (docs/design.md §5): it runs from its own venv, `.venv-optimum` beside the
project (`make optimum-venv` ahead of time, or `ensure_optimum_venv` during the corpus build).

Cache: `corpus_dir()` = $FFN_FUSION_CORPUS, else ~/.cache/ffn-fusion/corpus-v<CORPUS_VERSION>; every
entry is <dir>/<name>/model.onnx (+ model.onnx.data), written through a staging folder so a half-built
entry never counts. Build from the command line (the tests' fixture `third_party_corpus` in
tests/corpora/fixtures.py calls the same):

    python -m tests.corpora.third_party [--only NAME ...] [DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxruntime.transformers import optimizer

from passes.errors import UserError
from passes.io.model_io import load_model, save_model
from passes.model_map import AttentionBranch, build_model_map
from passes.patterns.attention import branch_nodes

CORPUS_VERSION = "1"  # bump when an entry's recipe changes: the cache key
ROOT = Path(__file__).resolve().parents[2]
OPTIMUM_VENV = ROOT / ".venv-optimum"
# onnx and onnxruntime: Optimum needs them to fix the exported dynamic axes (not its own dependencies).
OPTIMUM_REQUIREMENTS = ("optimum-onnx==0.1.0", "transformers>=4.57,<4.58", "onnx", "onnxruntime")
TORCH_PIN = "torch==2.13.0"  # the CPU build (docs/design.md §5), installed first
DROPPED: tuple[int, ...] = tuple(range(13, 23))
ENTRIES = ("optimum", "optimum-nopast", "genai-fp32", "genai-int4", "torchscript-17", "ort-optimizer",
           "dynamo-18", "dynamo-23")
# Which entries need the Optimum venv (they run in a second lane, beside the main venv's exports).
OPTIMUM_LANE = ("optimum", "optimum-nopast", "torchscript-17")

Log = Callable[[str], None]


def corpus_dir() -> Path:
    env = os.environ.get("FFN_FUSION_CORPUS")
    return Path(env) if env else Path.home() / ".cache" / "ffn-fusion" / f"corpus-v{CORPUS_VERSION}"


def entry_path(folder: Path, name: str) -> Path:
    return Path(folder) / name / "model.onnx"


# ------------------------------------------------------------------------------------------ venv


def optimum_python() -> Path:
    return OPTIMUM_VENV / "bin" / "python"


def ensure_optimum_venv(log: Log = print) -> Path:
    """The Optimum venv's python, created (torch pinned first, then optimum-onnx) when missing."""
    stamp = OPTIMUM_VENV / ".installed"
    wanted = " ".join((TORCH_PIN, *OPTIMUM_REQUIREMENTS))
    if stamp.exists() and stamp.read_text() == wanted:
        return optimum_python()
    log(f"creating {OPTIMUM_VENV} (transformers 4.57 for Optimum, docs/design.md §5)")
    if not optimum_python().exists():
        _run([sys.executable, "-m", "venv", str(OPTIMUM_VENV)])
    pip = [str(optimum_python()), "-m", "pip", "install", "--quiet"]
    _run([*pip, TORCH_PIN])
    _run([*pip, *OPTIMUM_REQUIREMENTS])
    stamp.write_text(wanted)
    return optimum_python()


def _run(command: Sequence[str], timeout: float = 1800) -> None:
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
        raise RuntimeError(f"{' '.join(map(str, command[:6]))} ... failed ({result.returncode}):\n{tail}")


# ------------------------------------------------------------------------------------------ exporters


def export_optimum(hf: Path, out: Path, with_past: bool) -> Path:
    task = "text-generation-with-past" if with_past else "text-generation"
    cli = optimum_python().parent / "optimum-cli"
    _run([cli, "export", "onnx", "--model", hf, "--task", task, out])
    return out / "model.onnx"


def export_torchscript(hf: Path, out: Path, opset: int = 17) -> Path:
    path = out / "model.onnx"
    _run([optimum_python(), Path(__file__).with_name("torchscript_hf.py"), hf, path, opset])
    return path


def export_genai(hf: Path, out: Path, precision: str) -> Path:
    _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", out, "-p", precision,
          "-e", "cpu", "-c", out / "cache"])
    shutil.rmtree(out / "cache", ignore_errors=True)
    return out / "model.onnx"


def optimize_ort(source: Path, out: Path) -> Path:
    """onnxruntime.transformers.optimizer, offline (opt_level 0): fuses RMSNorm into
    SimplifiedLayerNormalization and residual add + RMSNorm into SkipSimplifiedLayerNormalization."""
    model = optimizer.optimize_model(str(source), model_type="gpt2", num_heads=9, hidden_size=576,
                                     opt_level=0, use_gpu=False)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.onnx"
    model.save_model_to_file(str(path), use_external_data_format=True, all_tensors_to_one_file=True)
    return path


def export_dynamo(hf: Path, out: Path, opset: int, dropped: Sequence[int]) -> Path:
    """torch.onnx dynamo export of the folder's model with attention removed in the model itself."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only the dynamo export needs it)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the dynamo export needs it)

    from exporters.onnx_export import export_onnx  # noqa: PLC0415 (imports torch: only the dynamo export needs it)
    from exporters.smollm2 import remove_attention  # noqa: PLC0415 (imports transformers: only the dynamo export needs it)

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    remove_attention(model, dropped)
    path = out / "model.onnx"
    export_onnx(model, path, opset=opset, external_data_threshold=0)
    return path


# ------------------------------------------------------------------------------------------ surgery


def drop_attention(source: Path, target: Path, blocks: Sequence[int]) -> Path:
    """Remove the attention sub-block (and its input norm) of each block in `blocks`, the Nemotron-NAS
    way: the block becomes h + FFN(norm(h)). Its KV-cache inputs and outputs go too."""
    model = load_model(source)
    model_map = build_model_map(model)
    graph = model.graph
    for index in blocks:
        attention = model_map.attention_of(index)
        if attention is None:
            raise UserError(f"block {index} of {source} has no attention to drop")
        _bypass(graph, attention)
    RemoveUnusedNodesPass()(model)
    used = {v for node in graph.all_nodes() for v in node.inputs if v is not None} | set(graph.outputs)
    for value in [v for v in graph.inputs if v not in used]:
        graph.inputs.remove(value)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, target, external=True)
    return target


def _bypass(graph: ir.Graph, attention: AttentionBranch) -> None:
    body = branch_nodes(attention.output, attention.start)
    residual = attention.residual
    node = residual.node
    if node.op_type == "Add":
        ir.convenience.replace_all_uses_with(node.outputs[0], residual.stream_in)
    else:  # SkipSimplifiedLayerNormalization: its output 0 is the FFN's normalized input
        before = residual.stream_in.producer()
        if before is None or before.op_type != node.op_type or before.outputs[0] is not attention.start:
            raise UserError("cannot drop attention: its input norm is not a SkipSimplifiedLayerNormalization")
        before.replace_input_with(2, node.inputs[2])
        ir.convenience.replace_all_uses_with(node.outputs[0], before.outputs[0])
        if len(node.outputs) > 3:
            ir.convenience.replace_all_uses_with(node.outputs[3], before.outputs[3])
    produced = {v for n in body for v in n.outputs}
    for value in [v for v in graph.outputs if v in produced]:
        graph.outputs.remove(value)


# ------------------------------------------------------------------------------------------ the corpus


def build_corpus(
    folder: Path | None = None, names: Sequence[str] = ENTRIES, log: Log = print
) -> dict[str, Path]:
    """Build the missing entries of the corpus in `folder` (default `corpus_dir()`); their model paths."""
    folder = Path(folder) if folder is not None else corpus_dir()
    unknown = sorted(set(names) - set(ENTRIES))
    if unknown:
        raise UserError(f"unknown corpus entries {unknown}; known: {', '.join(ENTRIES)}")
    wanted = list(names) + (["dynamo-18"] if "ort-optimizer" in names else [])
    missing = [n for n in dict.fromkeys(wanted) if not entry_path(folder, n).exists()]
    if missing:
        _build(folder, missing, log)
    return {name: entry_path(folder, name) for name in names}


def _build(folder: Path, missing: list[str], log: Log) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    hf = folder / "hf"
    if not (hf / "config.json").exists():
        from exporters.hf.folder import save_smollm2  # noqa: PLC0415 (torch and transformers: only when the folder is built)

        _timed(log, "hf folder", lambda: save_smollm2(_fresh(folder / "hf.partial"), DROPPED))
        (folder / "hf.partial").rename(hf)
    optimum_lane = [n for n in missing if n in OPTIMUM_LANE]
    main_lane = [n for n in missing if n not in OPTIMUM_LANE and n != "ort-optimizer"]
    with ThreadPoolExecutor(2) as pool:  # the two venvs' exports side by side (2 cores)
        jobs = [pool.submit(_lane, folder, hf, lane, log) for lane in (optimum_lane, main_lane) if lane]
        for job in jobs:
            job.result()
    if "ort-optimizer" in missing:
        _entry(folder, hf, "ort-optimizer", log)


def _lane(folder: Path, hf: Path, names: list[str], log: Log) -> None:
    if any(name in OPTIMUM_LANE for name in names):
        ensure_optimum_venv(log)  # while the other lane exports
    for name in names:
        _entry(folder, hf, name, log)


def _entry(folder: Path, hf: Path, name: str, log: Log) -> None:
    raw = _fresh(folder / f"{name}.raw")
    staged = _fresh(folder / f"{name}.partial")
    exports: dict[str, Callable[[], Path]] = {
        "optimum": lambda: export_optimum(hf, raw, with_past=True),
        "optimum-nopast": lambda: export_optimum(hf, raw, with_past=False),
        "genai-fp32": lambda: export_genai(hf, raw, "fp32"),
        "genai-int4": lambda: export_genai(hf, raw, "int4"),
        "torchscript-17": lambda: export_torchscript(hf, raw, 17),
        "ort-optimizer": lambda: optimize_ort(entry_path(folder, "dynamo-18"), raw),
        "dynamo-18": lambda: export_dynamo(hf, staged, 18, DROPPED),
        "dynamo-23": lambda: export_dynamo(hf, staged, 23, DROPPED),
    }
    exported = _timed(log, f"{name}: export", exports[name])
    if exported.parent == raw and name != "ort-optimizer":
        _timed(log, f"{name}: drop attention {DROPPED[0]}-{DROPPED[-1]}",
               lambda: drop_attention(exported, staged / "model.onnx", DROPPED))
    elif exported.parent == raw:
        for path in raw.iterdir():
            path.rename(staged / path.name)
    for extra in raw.glob("*.json"):  # configs and tokenizer files, for the tools that read a folder
        shutil.copy(extra, staged / extra.name)
    shutil.rmtree(raw)
    target = folder / name
    shutil.rmtree(target, ignore_errors=True)
    staged.rename(target)


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _timed(log: Log, what: str, action: Callable[[], object]):
    start = time.perf_counter()
    result = action()
    log(f"{what}: {time.perf_counter() - start:.1f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m tests.corpora.third_party", description=description)
    parser.add_argument("folder", type=Path, nargs="?", help=f"corpus folder (default {corpus_dir()})")
    parser.add_argument("--only", nargs="+", choices=ENTRIES, default=list(ENTRIES), help="entries to build")
    args = parser.parse_args(argv)
    paths = build_corpus(args.folder, args.only, log=lambda m: print(m, flush=True))
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    from passes.errors import run_cli

    run_cli(lambda: main())
