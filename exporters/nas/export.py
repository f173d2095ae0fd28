"""Write a fused or healed ONNX graph as a Nemotron-NAS (DeciLM) Hugging Face checkpoint folder, or as a
GGUF file of llama.cpp's `deci` architecture.

    export_checkpoint("fused/model.onnx", "source_ckpt", "out_ckpt")   # docs/deploy.md
    export_gguf("fused/model.onnx", "source_ckpt", "out.gguf", dtype="q8_0")

One layout (which layer and tensor comes from where) for both: exporters.nas.layout. The streamed
safetensors writer is exporters.nas.safetensors_out, the FP8 form exporters.nas.fp8; the GGUF writer
exporters.nas.gguf_out, its tokenizer exporters.nas.gguf_vocab. When the weights are kernel copies,
exporters.nas.early_copy starts writing the checkpoint from a guess before onnx_ir and the recognizer load,
and the guess is kept only if the layout agrees with it. Everything is written into a staging folder (or
file) beside the output and renamed into place at the end: a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from exporters.hf.config import DTYPES, read_config
from exporters.nas import early_copy
from exporters.nas.safetensors_out import (
    DEFAULT_SHARD_BYTES,
    out_tensor,
    write_checkpoint,
)
from passes.errors import UserError

if TYPE_CHECKING:  # onnx_ir and what needs it load after the early copy has started (~2 s)
    from exporters.nas.layout import NasLayout

FP8_MODES = ("per-channel", "per-tensor")  # exporters.nas.fp8 (which loads onnx_ir)

# The remote-code files of a released DeciLM folder (transformers needs them; vLLM and TRT-LLM do not).
REMOTE_CODE_GLOB = "*.py"


@dataclass
class CheckpointResult:
    output: Path
    files: list[Path]
    bytes: int
    seconds: float
    layers: int
    source_layers: list[list[int]]
    block_configs: list[dict]
    dtype: str
    fp8: str | None = None
    side_files: list[str] = field(default_factory=list)
    early_copy: bool = False  # the weights were written from exporters.nas.early_copy's (confirmed) guess


def export_checkpoint(
    onnx_path: str | os.PathLike,
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str | None = None,
    fp8: str | None = None,
    fp8_scales: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    log: Callable[[str], None] = lambda message: None,
) -> CheckpointResult:
    """Write the model of `onnx_path` (exported from the checkpoint folder `source` by export_model.py --hf,
    then fused and/or healed) as a Nemotron-NAS checkpoint folder `output` (must not exist, or be empty).

    `dtype` defaults to the source's; `fp8` ("per-channel" | "per-tensor", exporters.nas.fp8) writes the
    linear layers as NVIDIA ModelOpt's FP8 export does (`fp8_scales`: this project's calibration file,
    needed by "per-tensor"). UserError for bad input, before anything is written where possible.
    """
    start = time.perf_counter()
    onnx_path, source, output = Path(onnx_path), Path(source), Path(output)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if fp8 is not None and fp8 not in FP8_MODES:
        raise UserError(f"--fp8 {fp8!r}: choose one of {', '.join(FP8_MODES)}")
    if not onnx_path.is_file():
        raise UserError(f"{onnx_path} not found")
    if not source.is_dir():
        raise UserError(f"--source {source}: not a checkpoint folder")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"-o {output}: exists and is not an empty folder; choose a new folder")
    if fp8 == "per-tensor" and fp8_scales is None:
        raise UserError("--fp8 per-tensor needs --fp8-scales (this project's calibration of the graph)")
    source_config = read_config(source)
    dtype = dtype or source_config.dtype
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}."))
    early, kept = None, False
    try:
        if fp8 is None:
            early = early_copy.start(onnx_path, source_config, dtype, staging, max_shard_bytes)
        # Loaded here, while the early copy runs: onnx_ir, the recognizer, numpy's converters.
        from exporters.nas.layout import plan_layout  # noqa: PLC0415 (onnx_ir: loaded only once the early copy has started)
        from passes.io.model_io import load_model  # noqa: PLC0415 (onnx_ir: loaded only once the early copy has started)

        model = load_model(onnx_path)
        layout = plan_layout(model, source, onnx_path)
        layout.config["torch_dtype"] = dtype
        layout.config.pop("dtype", None)
        log(
            f"exporting {onnx_path} as a Nemotron-NAS checkpoint: {len(layout.source.layers)} -> "
            f"{len(layout.layers)} layers, {dtype}{f', FP8 {fp8}' if fp8 else ''} ..."
        )
        quant = None
        if fp8 is not None:
            from exporters.nas.fp8 import fp8_tensors  # noqa: PLC0415 (only for --fp8)
            from passes.quant.calibrate import ActivationScales  # noqa: PLC0415 (only for --fp8)

            scales = ActivationScales.load(fp8_scales) if fp8_scales is not None else None
            tensors, quant = fp8_tensors(layout, model, dtype, fp8, scales)
        else:
            tensors = [out_tensor(t, dtype) for t in layout.tensors]
        if early is not None and early.matches(tensors):
            files = early.finish()
            early, kept = None, True
        else:
            if early is not None:  # the guess was wrong: its files go, the real list is written
                early.cancel()
                early = None
                for path in staging.iterdir():
                    path.unlink()
            files = write_checkpoint(staging, tensors, max_shard_bytes, log)
        side = _write_side_files(staging, layout, source, quant)
        if output.is_dir():
            output.rmdir()
        os.rename(staging, output)
    finally:
        if early is not None:
            early.cancel()
        shutil.rmtree(staging, ignore_errors=True)
    written = [output / f.name for f in files] + [output / name for name in side]
    return CheckpointResult(
        output=output,
        files=written,
        bytes=sum(f.stat().st_size for f in written),
        seconds=time.perf_counter() - start,
        layers=len(layout.layers),
        source_layers=layout.source_layers,
        block_configs=layout.config["block_configs"],
        dtype=dtype,
        fp8=fp8,
        side_files=side,
        early_copy=kept,
    )


def _write_side_files(staging: Path, layout: NasLayout, source: Path, quant: dict | None) -> list[str]:
    """config.json (+ the quantization config), hf_quant_config.json, the tokenizer and generation files,
    and a DeciLM source's remote code."""
    from exporters.hf.checkpoint import SIDE_FILES  # noqa: PLC0415 (its imports, numpy, would delay the early copy)

    config = dict(layout.config)
    if quant is not None:
        config["quantization_config"] = quant["config_json"]
        (staging / "hf_quant_config.json").write_text(json.dumps(quant["hf_quant_config"], indent=4) + "\n")
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = [n for n in SIDE_FILES if n != "config.json" and (source / n).is_file()]
    if layout.source.is_deci:
        copied += sorted(p.name for p in source.glob(REMOTE_CODE_GLOB))
    for name in copied:
        shutil.copyfile(source / name, staging / name)
    return ["config.json", *(["hf_quant_config.json"] if quant is not None else []), *copied]


@dataclass
class GgufResult:
    output: Path
    bytes: int
    seconds: float
    dtype: str
    layers: int  # GGUF layers (blk.N)
    source_layers: list[list[int]]  # per GGUF layer, the source checkpoint layers it computes
    source_layer_count: int
    vocab: str  # the tokenizer written (exporters.nas.gguf_vocab)
    notes: dict[int, str] = field(default_factory=dict)  # GGUF layer -> how it differs from the converter's


def export_gguf(
    onnx_path: str | os.PathLike,
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str = "f32",
    log: Callable[[str], None] | None = None,
) -> GgufResult:
    """Write the model of `onnx_path` (exported from the checkpoint folder `source` by export_model.py --hf,
    then fused and/or healed) as one GGUF file `output` (must not exist) of llama.cpp's `deci` architecture,
    with the source's tokenizer: `dtype` "f32" | "f16" | "bf16" | "q8_0" for the matrices (norms stay
    float32). UserError for bad input, before anything is written where possible."""
    from exporters.nas.gguf_out import GGUF_DTYPES  # noqa: PLC0415 (gguf: only for --gguf)

    start = time.perf_counter()
    log = log or (lambda message: None)
    onnx_path, source, output = Path(onnx_path), Path(source), Path(output)
    if dtype not in GGUF_DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(GGUF_DTYPES)} for a GGUF file")
    if not onnx_path.is_file():
        raise UserError(f"{onnx_path} not found")
    if not source.is_dir():
        raise UserError(f"--source {source}: not a checkpoint folder")
    if output.exists() or output.is_symlink():
        raise UserError(f"-o {output}: exists; choose a new file name")
    from exporters.nas.gguf_out import ARCH, Writer, add_metadata, gguf_tensor, plan_gguf, write_gguf  # noqa: PLC0415 (gguf: only for --gguf)
    from exporters.nas.gguf_vocab import add_vocab  # noqa: PLC0415 (gguf: only for --gguf)
    from exporters.nas.layout import plan_layout  # noqa: PLC0415 (onnx_ir: loaded only after the argument checks)
    from passes.io.model_io import load_model  # noqa: PLC0415 (onnx_ir: loaded only after the argument checks)

    layout = plan_layout(load_model(onnx_path), source, onnx_path)
    plan = plan_gguf(layout)
    log(
        f"exporting {onnx_path} as a llama.cpp GGUF (deci): {len(layout.source.layers)} -> "
        f"{len(plan.layers)} layers, {dtype} ..."
    )
    tensors = [gguf_tensor(t, dtype) for t in plan.tensors]
    writer = Writer(None, ARCH)
    add_metadata(writer, layout, plan, dtype, source.resolve().name)
    vocab = add_vocab(writer, source, layout.source.vocab)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".partial")
    os.close(fd)
    staging = Path(staging)
    os.chmod(staging, 0o644)  # mkstemp's 0o600 is for the staging name only
    try:
        size = write_gguf(staging, writer, tensors, log)
        os.rename(staging, output)
    finally:
        writer.close()
        staging.unlink(missing_ok=True)
    return GgufResult(
        output=output,
        bytes=size,
        seconds=time.perf_counter() - start,
        dtype=dtype,
        layers=len(plan.layers),
        source_layers=[layer.source_layers for layer in plan.layers],
        source_layer_count=len(layout.source.layers),
        vocab=vocab,
        notes={i: layer.note for i, layer in enumerate(plan.layers) if layer.note},
    )
