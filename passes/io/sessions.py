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
    try:
        return ort.InferenceSession(
            source, options, providers=list(providers), disabled_optimizers=ORT_DISABLED_OPTIMIZERS
        )
    except ort.capi.onnxruntime_pybind11_state.NotImplemented as exc:
        # The CPU provider has no bfloat16 kernels for most ops (Mul, MatMul, ...): the user's fix is a
        # float32 (or float16) export, not a bug report.
        if "bfloat16" in str(exc) or (providers == CPU and _has_bfloat16(model, str(exc))):
            raise UserError(
                "ONNX Runtime's CPU provider cannot run this bfloat16 graph "
                f"({str(exc).split(':')[-1].strip()}): export it with --dtype float32 (or float16)"
            ) from None
        raise


def _has_bfloat16(model: str | Path | onnx.ModelProto | bytes, message: str) -> bool:
    """Whether the failing model holds bfloat16 tensors (read without its weights)."""
    if isinstance(model, str | Path):
        proto = onnx.load(str(model), load_external_data=False)
    elif isinstance(model, bytes):
        proto = onnx.load_from_string(model)
    else:
        proto = model
    bf16 = onnx.TensorProto.BFLOAT16
    values = [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]
    return "Could not find an implementation" in message and (
        any(v.type.tensor_type.elem_type == bf16 for v in values)
        or any(t.data_type == bf16 for t in proto.graph.initializer)
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
