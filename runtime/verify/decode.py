"""Decode graphs (exporters/decode.py, ffn_fusion.decode metadata): cached decoding (a prefill of half the
prompt, then one token at a time through the KV cache) equals the graph's own uncached prefill of the whole
prompt, and that prefill equals the source's logits on the same prompt.

Above block_runner.STREAMING_BYTES of weights the decode graph runs block by block
(passes/run/decode_stream.py: every call through one block before the next block loads), with the same
checks and bounds; a half graph with a half-precision cache runs whole (as common.logits)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.error_measures import max_abs_relative_error
from passes.graph_inputs import Signature
from passes.io.model_io import load_model, load_proto, weight_bytes
from passes.metadata import DECODE_METADATA_KEY
from passes.model_map import find_blocks, vocab_size
from passes.run import block_runner
from passes.run.decode_stream import DecodeCall, DecodeStreamer
from runtime.generate import DecodeModel
from runtime.verify.common import half_view, has_half_input, logits, metadata_json
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport


def decode_calls(ids: np.ndarray, cached: bool) -> list[DecodeCall]:
    """The check's forward calls: the uncached prefill of the whole prompt, then half the prompt and one token
    at a time through the cache (a graph without a cache re-runs the prefix: what generation does then)."""
    mask = np.ones_like(ids)
    length, half = ids.shape[1], ids.shape[1] // 2
    calls = [DecodeCall(ids, mask), DecodeCall(ids[:, :half], mask[:, :half])]
    for t in range(half, length):
        if cached:
            calls.append(DecodeCall(ids[:, t : t + 1], mask[:, : t + 1], len(calls) - 1))
        else:
            calls.append(DecodeCall(ids[:, : t + 1], mask[:, : t + 1]))
    return calls


def whole_logits(model: DecodeModel, calls: list[DecodeCall]) -> list[np.ndarray]:
    """Every call's logits in one session of the whole graph, each call's cache kept for the call after it."""
    caches: dict[int, dict[str, np.ndarray] | None] = {}
    out = []
    for k, call in enumerate(calls):
        cache = model.empty_cache(1) if call.after is None and model.cached else caches.get(call.after)
        step, caches[k] = model.forward(call.ids, call.mask, cache)
        out.append(step)
    return out


def verify_decode(report: VerifyReport, options: VerifyOptions) -> None:
    described = metadata_json(report.artifact, DECODE_METADATA_KEY) or {}
    vocab = vocab_size(find_blocks(load_model(report.original)))
    length = max(options.seq, 2)
    half = length // 2
    ids = np.random.default_rng(0).integers(0, vocab, size=(1, length), dtype=np.int64)
    proto = load_proto(report.artifact)
    signature = Signature.of(proto)
    layers = [i.layer for i in signature.cache_inputs if i.kind == "key" and i.layer is not None]
    report.notes.append(
        f"decode graph: KV cache for layers {layers}"
        + (f" ({len(described.get('layers', []))} layers described)" if "layers" in described else "")
    )
    calls = decode_calls(ids, bool(signature.cache_inputs))
    view = half_view(report.artifact, proto)
    size = weight_bytes(ir.serde.deserialize_model(proto))  # sizes from the headers only
    wiring: list[str] = []
    large = size > block_runner.STREAMING_BYTES
    if large and not (view is not None and has_half_input(proto)):
        streamer = DecodeStreamer(report.artifact, view=view)
        report.notes.append(
            f"decode graph run block by block ({size / 2**30:.2f} GiB of weights: one block's at a time)"
        )
        wiring = streamer.wiring_errors()
        # A cache that another block writes cannot run layer-major: the prefill alone still runs.
        results = streamer.run(calls[:1] if wiring else calls)
        del streamer
    else:
        if large:
            report.notes.append("decode graph run whole: a half-precision cache input (no float32 view)")
        results = whole_logits(DecodeModel.open(report.artifact), calls)
    full = results[0]
    bound = options.decode_tolerance
    if wiring:
        report.add("cached decoding vs prefill", False, f"cache wiring: {'; '.join(wiring)}")
    else:
        # The steps' last positions (a cached step has only that one; an uncached one re-ran the prefix).
        cached = np.concatenate([results[1]] + [r[:, -1:] for r in results[2:]], axis=1)
        error = max_abs_relative_error(cached, full)
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
