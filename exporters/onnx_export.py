"""Write ONNX models through torch.onnx's dynamo exporter.

Every model gets one input `input_ids` (int64 [batch, seq]) and one output `logits` (float32
[batch, seq, vocab]), both dims dynamic and named "batch" and "seq". The exporter's default optimizer
stays on (it folds weight transposes into [in, out] initializers), and the node metadata it writes
(`pkg.torch.onnx.name_scopes`, ...) is kept.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import types
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from exporters.export_record import ExportResult
from exporters.llama import build_model, count_parameters
from exporters.smollm2_tokenizer import PRUNED_BLOCKS
from exporters.spec import ModelSpec
from passes.io.data_files import data_files
from passes.io.model_io import EXTERNAL_DATA_THRESHOLD, save_model, weight_bytes

# Example input used for tracing; neither dim is 0 or 1, so the exporter does not specialize them.
EXAMPLE_SHAPE = (2, 7)


def _hf_logits_forward(self: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return type(self).forward(self, input_ids=input_ids, use_cache=False).logits.float()


@contextlib.contextmanager
def _logits_only(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Make a Hugging Face causal LM's forward(input_ids) return logits without a KV cache, for the export.

    The forward is patched on the instance instead of wrapping the model in another module, so the
    exported name scopes and initializer names read like the checkpoint's (model.layers.N..., lm_head).
    """
    if not _is_hf_model(module):
        yield module
        return
    module.forward = types.MethodType(_hf_logits_forward, module)
    try:
        yield module
    finally:
        del module.forward


def _is_hf_model(module: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel  # noqa: PLC0415 (transformers: seconds to import; optional here, hand-written models need none)
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


@contextlib.contextmanager
def quiet_export() -> Iterator[io.StringIO]:
    """Swallow the exporter's progress prints, warnings and info logs; yields what was printed."""
    buffer = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript",
                                              "torch.fx.experimental.symbolic_shapes", "transformers")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer):
            warnings.simplefilter("ignore")
            yield buffer
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def without_slices_split() -> Iterator[None]:
    """onnxscript's default rewrite rules without SlicesSplit while the exporter's optimizer runs.

    SlicesSplit (Slice(x), Slice(x) -> Split(x)) has two output nodes, and onnxscript's matcher indexes the
    whole graph for every node it tries such a rule on: quadratic in the graph's size (13.5 of the 16.9 CPU
    seconds of optimizing the demo's 30-layer decode graph). It never fires on these models: it needs the
    second Slice to end at the last dim exactly, and torch writes rotate_half's x[..., half:] with end
    INT64_MAX. Without it the optimized graph is byte for byte the same (tests/exporters/test_decode.py).
    """
    from onnxscript import rewriter  # noqa: PLC0415 (onnxscript: ~0.5 s; torch.onnx's optimizer imports it anyway when it runs)

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)  # private: if it moves, optimize as before
    if rules is None:
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) != "SlicesSplit")
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def dynamo_export(module: torch.nn.Module, args: tuple, *, opset: int | None, optimize: bool,
                  input_names: list[str], output_names: list[str], dynamic_shapes: Any) -> Any:
    """torch.onnx.export(dynamo=True) without its prints and warnings, under torch.no_grad(); returns the
    ONNXProgram. Raises RuntimeError with what the exporter printed if it fails."""
    with quiet_export() as printed, torch.no_grad(), without_slices_split():
        try:
            return torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, optimize=optimize, input_names=input_names,
                output_names=output_names, dynamic_shapes=dynamic_shapes, verbose=False, report=False)
        except Exception as exc:
            raise RuntimeError(f"torch.onnx.export failed: {exc}\n{printed.getvalue()}") from exc


def save_export(model: ir.Model, path: Path, external_data_threshold: int) -> list[Path]:
    """Save an exported model: its weights in `<name>.data` beside it when they pass the threshold, else one
    file (data files of an earlier export there are removed: they would mislead). The files written."""
    save_model(model, path, weight_bytes(model) > external_data_threshold)
    return [path, *data_files(path)]


def export_onnx(module: torch.nn.Module, path: str | os.PathLike, *, opset: int | None = None,
                external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> ExportResult:
    """Export `module` (forward(input_ids) -> logits, or a Hugging Face causal LM) to `path`.

    Weights go to one file `<path name>.data` beside the model when they pass
    `external_data_threshold` bytes, otherwise everything is in one file. `opset=None` takes the
    exporter's default. Raises RuntimeError with the exporter's output if the export fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module.eval()
    example = torch.zeros(EXAMPLE_SHAPE, dtype=torch.int64)
    start = time.perf_counter()
    with _logits_only(module) as traced:
        program = dynamo_export(traced, (example,), opset=opset, optimize=True, input_names=["input_ids"],
                                output_names=["logits"], dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}})
    model = program.model
    _name_dims(model)
    files = save_export(model, path, external_data_threshold)
    seconds = time.perf_counter() - start
    return ExportResult(path=path, files=files, bytes=sum(f.stat().st_size for f in files), seconds=seconds,
                        parameters=count_parameters(module), opset=model.opset_imports.get("", 0))


def _name_dims(model: ir.Model) -> None:
    """Make sure input and output dims carry the names "batch" and "seq" (the exporter may write s0/s1)."""
    names = {}
    for dim, name in zip(model.graph.inputs[0].shape, ("batch", "seq"), strict=True):
        if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            names[dim.value] = name
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if value.shape is None:
            continue
        dims = [ir.SymbolicDim(names.get(d.value, d.value)) if isinstance(d, ir.SymbolicDim) else d
                for d in value.shape]
        value.shape = ir.Shape(dims)


def export_spec_model(spec: ModelSpec, path: str | os.PathLike, seed: int = 0, *, opset: int | None = None,
                      external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> ExportResult:
    """Build the SpecLlama for `spec` with seeded random weights and export it."""
    result = export_onnx(build_model(spec, seed), path, opset=opset,
                         external_data_threshold=external_data_threshold)
    result.attention = spec.attention_flags
    return result


def export_smollm2(path: str | os.PathLike, drop_attention: Iterable[int] = PRUNED_BLOCKS, *,
                   opset: int | None = None,
                   external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> ExportResult:
    """Export SmolLM2-135M-Instruct, with attention removed from the blocks in `drop_attention`.

    The default, blocks 13-22, is the project's standard pruned variant; pass () for the unchanged model.
    """
    from exporters import smollm2  # noqa: PLC0415 (transformers: seconds to import; only the SmolLM2 export needs it)

    drop_attention = smollm2.check_blocks(drop_attention)  # before the slow load
    model = smollm2.remove_attention(smollm2.load_torch_model(), drop_attention)
    result = export_onnx(model, path, opset=opset, external_data_threshold=external_data_threshold)
    result.attention = smollm2.attention_flags(model)
    return result
