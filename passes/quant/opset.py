"""Raising a model's default opset with every node converted (onnxscript's converter from opset 18, onnx's
own below it), refusing what the converters leave invalid."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import onnx
import onnx_ir as ir

from passes.errors import UserError

# ONNX Runtime registers some contrib ops (SimplifiedLayerNormalization, ...) in the default domain. onnx's
# version converter has no schema for them and refuses the whole graph, but leaves other domains alone:
# they wait in this domain while the opset is raised.
_ASIDE_DOMAIN = "ffn_fusion.no_onnx_schema"
_CONVERTER_FAILURES = ("Failed to convert", "Skipping version conversion")


def raise_opset(model: ir.Model, target: int, minimum: int, purpose: str) -> tuple[int, int]:
    """Raise the default opset to `target` (at least `minimum`, what `purpose` needs), converting every
    node that changed on the way (ReduceMean's axes attribute becomes an input at 18, ...): onnxscript's
    converter from opset 18, onnx's own below it. Weights are not read (the converters see the graph
    without its large initializers). Returns the opset (before, after)."""
    before = model.opset_imports.get("", 1)
    if before >= target:
        return before, before
    from onnxscript.version_converter import ConvertVersionPass  # noqa: PLC0415 (onnxscript's converter: slow to import; only when the opset must rise)

    _move_domain(model, "", _ASIDE_DOMAIN, lambda node: not onnx.defs.has(node.op_type, ""))
    with _captured_warnings("onnxscript.version_converter") as warnings:
        try:
            ConvertVersionPass(target, fallback=True)(model)
        except Exception as exc:  # the converters raise assorted errors for ops they cannot convert
            warnings.append(f"{type(exc).__name__}: {str(exc).strip()}")
            warnings[-1] = f"{_CONVERTER_FAILURES[0]}: {warnings[-1]}"
    _move_domain(model, _ASIDE_DOMAIN, "", lambda node: True)
    failures = [w.splitlines()[0] for w in warnings if w.startswith(_CONVERTER_FAILURES)]
    after = model.opset_imports.get("", before)
    problem = failures[0] if failures else schema_violation(model, after)
    if after < minimum or problem:
        raise UserError(
            f"cannot raise the model's opset from {before} to {target} for {purpose}"
            + (f" ({problem})" if problem else "")
            + f"; re-export it with opset >= {target}"
        )
    return before, after


def _move_domain(model: ir.Model, source: str, target: str, chosen) -> None:
    moved = False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == source and chosen(node):
            node.domain, moved = target, True
    if source == _ASIDE_DOMAIN:
        model.opset_imports.pop(source, None)
    elif moved:
        model.opset_imports[target] = 1


@contextlib.contextmanager
def _captured_warnings(logger_name: str) -> Iterator[list[str]]:
    """Collect a logger's warnings instead of printing them (the converter logs its failures)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def schema_violation(model: ir.Model, opset: int) -> str | None:
    """A node the conversion left invalid at `opset` (an attribute its schema no longer has), if any."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != "" or not onnx.defs.has(node.op_type, ""):
            continue
        schema = onnx.defs.get_schema(node.op_type, opset, "")
        unknown = sorted(set(node.attributes) - set(schema.attributes))
        if unknown:
            return f"{node.op_type} node {node.name!r} keeps attribute {unknown[0]!r}, gone at opset {opset}"
    return None
