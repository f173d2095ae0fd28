"""The one way this project opens an ONNX Runtime session: passes, runtimes, tools and benchmarks.

Every session gets the same settings, so that a fix reaches all of them:
- ONNX Runtime's ReluQuantRewrite is disabled. It drops a Relu in front of a QuantizeLinear whose zero
  point is 0, as if the quantized range started at 0; for float8 it does not (measured: relative error
  0.89 instead of 0.047 on Relu -> Q -> DQ -> MatMul). Disabling it changes nothing for other graphs.
- Warnings are quiet (ORT warns about every unused initializer of a cut subgraph).
- A model given as a proto (a cut or rewritten graph in memory) reads its external data from `folder`.
- `prepack=False` keeps ORT from making a second, prepacked copy of the weights (validation of big
  models, where memory is the bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
import onnxruntime as ort

from passes.errors import UserError

ORT_DISABLED_OPTIMIZERS = ["ReluQuantRewrite"]
CPU = ("CPUExecutionProvider",)
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def session_options(threads: int | None = None, prepack: bool = True) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def open_session(
    model: str | Path | onnx.ModelProto | bytes,
    *,
    folder: str | Path | None = None,
    threads: int | None = None,
    providers: Sequence[str] = CPU,
    prepack: bool = True,
) -> ort.InferenceSession:
    """An InferenceSession on a file path, or on a proto whose external data lies in `folder`."""
    options = session_options(threads, prepack)
    if isinstance(model, str | Path):
        source: str | bytes = str(model)
    else:
        source = model if isinstance(model, bytes) else model.SerializeToString()
        if folder is not None:
            options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(Path(folder).resolve()))
    return ort.InferenceSession(
        source, options, providers=list(providers), disabled_optimizers=ORT_DISABLED_OPTIMIZERS
    )


def providers_for(device: str = "cpu") -> list[str]:
    """Execution providers for `device`: "cpu", "cuda" (error if unavailable) or "auto"."""
    if device == "cpu":
        return list(CPU)
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", *CPU]
    if device == "cuda":
        raise UserError("the CUDA provider is not available: install onnxruntime-gpu on a machine with a GPU")
    if device != "auto":
        raise UserError(f"unknown device {device!r}; use cpu, cuda or auto")
    return list(CPU)
