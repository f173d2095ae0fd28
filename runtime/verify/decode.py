"""Decode graphs (exporters/decode.py, ffn_fusion.decode metadata): cached decoding (a prefill of half the
prompt, then one token at a time through the KV cache) equals the graph's own uncached prefill of the whole
prompt, and that prefill equals the source's logits on the same prompt."""

from __future__ import annotations

import numpy as np

from exporters.decode_spec import METADATA_KEY
from passes.error_measures import max_abs_relative_error
from passes.io.model_io import load_model
from passes.model_map import find_blocks, vocab_size
from runtime.generate import DecodeModel
from runtime.verify.common import logits, metadata_json
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport


def verify_decode(report: VerifyReport, options: VerifyOptions) -> None:
    described = metadata_json(report.artifact, METADATA_KEY) or {}
    vocab = vocab_size(find_blocks(load_model(report.original)))
    length = max(options.seq, 2)
    ids = np.random.default_rng(0).integers(0, vocab, size=(1, length), dtype=np.int64)
    model = DecodeModel.open(report.artifact)
    report.notes.append(
        f"decode graph: KV cache for layers {model.cache_layers}"
        + (f" ({len(described.get('layers', []))} layers described)" if "layers" in described else "")
    )
    mask = np.ones_like(ids)
    full, _ = model.forward(ids, mask, model.empty_cache(1) if model.cached else None)
    half = length // 2
    step, cache = model.forward(ids[:, :half], mask[:, :half], model.empty_cache(1) if model.cached else None)
    pieces = [step]
    for t in range(half, length):
        if cache is None:  # a graph without a cache: re-run the prefix (what generation does then)
            step, _ = model.forward(ids[:, : t + 1], mask[:, : t + 1], None)
            pieces.append(step[:, -1:])
        else:
            step, cache = model.forward(ids[:, t : t + 1], mask[:, : t + 1], cache)
            pieces.append(step)
    cached = np.concatenate(pieces, axis=1)
    error = max_abs_relative_error(cached, full)
    bound = options.decode_tolerance
    report.add(
        "cached decoding vs prefill",
        error <= bound,
        f"{half} prompt tokens then {length - half} cached steps: max-abs relative error {error:.3g} "
        f"(<= {bound:g})",
        max_abs_rel_error=error,
        tolerance=bound,
    )
    source = logits(report.original, ids)
    if source.shape != full.shape:
        report.add("prefill vs source", False, f"logits {list(full.shape)}, source {list(source.shape)}")
        return
    error = max_abs_relative_error(full, source)
    report.add(
        "prefill vs source",
        error <= bound,
        f"{length} tokens: max-abs relative error {error:.3g} (<= {bound:g})",
        max_abs_rel_error=error,
        tolerance=bound,
    )
