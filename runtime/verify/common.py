"""Pieces every artifact check uses: reading the metadata, running a graph to its logits, and comparing the
initializers an artifact shares by name with its source, one tensor at a time (memory: one tensor)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from passes.graph_inputs import Signature
from passes.io.model_io import load_proto, weight_bytes
from passes.io.sessions import open_session
from passes.run import block_runner
from passes.validate import HALF_TYPES, float32_view
from runtime.verify.records import VerifyReport


def metadata(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in load_proto(path).metadata_props}


def metadata_json(path: Path, key: str) -> dict | None:
    text = metadata(path).get(key)
    return None if text is None else json.loads(text)


def tensor_sha256(tensor: ir.TensorProtocol) -> str:
    """sha256 of the tensor's stored bytes (as heal.py records them: runtime/heal/metadata.py)."""
    return hashlib.sha256(tensor.tobytes()).hexdigest()


def logits(path: Path, tokens: np.ndarray) -> np.ndarray:
    """`path`'s first logits output on `tokens` in ONNX Runtime (every other input fed as
    passes/graph_inputs.py does: mask of ones, positions, an empty KV cache); half models in fp32.

    A graph above block_runner.STREAMING_BYTES of weights runs block by block (model_logits: one block's
    weights in memory at a time, as fusion's validation), a half graph each block in its float32 view. Whole:
    float8 graphs (no block walk reads them: runtime/verify/fp8.py streams them by their source's blocks) and
    half graphs with a half-precision input (a KV cache: the streamed capture feeds the graph's own types)."""
    proto = load_proto(path)
    view = half_view(path, proto)
    whole_only = any(t.data_type == onnx.TensorProto.FLOAT8E4M3FN for t in proto.graph.initializer) or (
        view is not None and has_half_input(proto)
    )
    if not whole_only and weight_bytes(ir.serde.deserialize_model(proto)) > block_runner.STREAMING_BYTES:
        return block_runner.model_logits(path, tokens, view=view)  # (sizes read from the headers only)
    if view is not None:
        proto = view(proto)
    signature = Signature.of(proto)
    session = open_session(proto, folder=path.parent, prepack=False)
    return session.run([signature.logits.name], signature.feeds(tokens))[0]


def round_through(tensor: ir.TensorProtocol, dtype: np.dtype) -> ir.LazyTensor:
    """`tensor` rounded through `dtype` (nearest even) in its own dtype, computed when it is written: the
    source as a checkpoint of that dtype holds it."""

    def compute() -> ir.TensorProtocol:
        array = np.asarray(tensor.numpy()).astype(np.float32).astype(dtype).astype(np.float32)
        return ir.tensor(array.astype(tensor.dtype.numpy()), dtype=tensor.dtype, name=tensor.name)

    return ir.LazyTensor(compute, dtype=tensor.dtype, shape=tensor.shape, name=tensor.name)


def has_half_input(proto: onnx.ModelProto) -> bool:
    """A float16/bfloat16 graph input (a KV cache): a streamed capture feeds the graph's own input types,
    which a block's float32 view no longer has."""
    return any(v.type.tensor_type.elem_type in HALF_TYPES for v in proto.graph.input)


def half_view(path: Path, proto: onnx.ModelProto) -> Callable[[onnx.ModelProto], onnx.ModelProto] | None:
    """For a graph with float16/bfloat16 weights, its float32 view (passes.validate.float32_view: ONNX
    Runtime's CPU provider lacks bfloat16 MatMul), as a BlockRunner `view`; None for other graphs."""
    if not any(t.data_type in HALF_TYPES for t in proto.graph.initializer):
        return None
    return functools.partial(float32_view, folder=path.parent)


def release(*tensors: ir.TensorProtocol) -> None:
    """Unmap external tensors once compared: their file pages stop counting in the process (the mapping is
    made again if a tensor is read later)."""
    for tensor in tensors:
        if isinstance(tensor, ir.ExternalTensor):
            tensor.release()


def same_initializers(
    report: VerifyReport, original: ir.Model, artifact: ir.Model, skip: Iterable[str], what: str
) -> None:
    """One check: every initializer of `artifact` that `original` has by name (but those in `skip`, which
    the stage rewrote) holds the original's values. A differing one is named."""
    skip = set(skip)
    names = [n for n in artifact.graph.initializers if n in original.graph.initializers and n not in skip]
    differing = []
    for name in names:
        a = artifact.graph.initializers[name].const_value
        b = original.graph.initializers[name].const_value
        if a is None or b is None:
            continue
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or a.tobytes() != b.tobytes():
            differing.append(name)
        release(a, b)
    report.add_mismatches(
        "unchanged weights",
        [repr(n) for n in differing],
        len(names),
        f"{what} differ from the original's",
        f"{len(names)} {what} equal the original's",
    )
