"""Tensor-parallel rank folders (passes/shard/files.py, DIR/tp.json): every rank graph in its own process,
all-reducing over gloo (runtime/tp/ort.py run_gloo, as the server's ranks do), against the single-device
source within `tp_tolerance`."""

from __future__ import annotations

from passes.error_measures import max_abs_relative_error
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.shard import rank_onnx_files, read_manifest
from passes.validate import default_tokens
from runtime.tp.ort import run_gloo
from runtime.verify.common import logits
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport


def verify_tp(report: VerifyReport, options: VerifyOptions) -> None:
    manifest = read_manifest(report.artifact)
    files = rank_onnx_files(report.artifact)
    report.notes.append(
        f"tp={manifest['tp']}, {manifest.get('allreduces_per_forward', '?')} all-reduces per forward, "
        f"sharded from {manifest.get('source', '?')}"
    )
    tokens = default_tokens(find_blocks(load_model(report.original)), report.original, options.seq)
    reference = logits(report.original, tokens)
    ranks = run_gloo(report.artifact, tokens)
    if ranks.shape != reference.shape:
        report.add(
            "ranks vs source", False, f"rank logits {list(ranks.shape)}, source {list(reference.shape)}"
        )
        return
    error = max_abs_relative_error(ranks, reference)
    report.add(
        "ranks vs source",
        error <= options.tp_tolerance,
        f"{len(files)} ranks over gloo: max-abs relative error {error:.3g} (<= {options.tp_tolerance:g})",
        max_abs_rel_error=error,
        tolerance=options.tp_tolerance,
    )
