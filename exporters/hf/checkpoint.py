"""Export a Hugging Face checkpoint folder to ONNX without holding its weights in memory: the entry.

    export_hf(folder, "out/model.onnx", dtype=None)  ->  out/model.onnx + model.onnx.data + config.json, ...

How (see docs/export.md, "Hugging Face checkpoints"); each step is its own module:

1. config.json is read into per-layer shapes (exporters.hf.config) and the safetensors headers (one file or
   shards listed by model.safetensors.index.json; exporters.hf.safetensors_in) into a table name -> file,
   dtype, shape, byte range. Every tensor the model needs is checked against that table before anything
   is written (exporters.hf.weight_sources).
2. Each weight gets a page-aligned place in `<model>.data`, known from step 1 alone, so a second thread
   starts writing the data file at once, straight from the shards (exporters.hf.data_file): kernel copies
   when the dtype is kept, row chunks converted with numpy when it changes (exporters.hf.dtype_convert).
   Peak memory stays at the graph plus one chunk.
3. Meanwhile the graph is built directly with onnx-ir from the config (no torch, a fraction of a second):
   the prefill graph (exporters.hf.prefill_graph) or, for --decode, the KV-cache decode graph of
   exporters/decode.py's interface (exporters.hf.decode_graph, the same layer code). Every weight is an
   initializer named as its checkpoint tensor, with a shape and no value (linear weights stay [out, in],
   read through Transpose).
4. Each value-less initializer becomes an external-data reference to its place in `<model>.data`.

Everything is written into a staging folder beside the output and moved into place at the end, so a
failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from exporters.export_record import ExportResult
from exporters.hf.config import HfConfig, decode_spec, layer_kinds
from exporters.hf.data_file import ITEMSIZE, attach_weights, place_weights, write_data
from exporters.hf.dtype_convert import converts, import_converters
from exporters.hf.weight_sources import WeightSource, check_folder
from passes.errors import UserError
from passes.io.staging import commit_output, staged_output
from passes.metadata import HF_METADATA_KEY

if TYPE_CHECKING:  # onnx_ir (~1.5 s to import) loads once the weight copy runs
    import onnx_ir as ir

    from exporters.decode_spec import DecodeSpec

# Copied beside the model when present: what a runtime needs to load and prompt it.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# The prefill and decode graphs' ops mean the same from opset 18 (ReduceMean's axes as an input) to 23.
GRAPH_OPSETS = range(18, 24)


@dataclass(kw_only=True)
class HfExportResult(ExportResult):
    """What `export_hf` wrote: exporters.onnx_export.ExportResult, and the checkpoint's config and dtype."""

    config: HfConfig
    dtype: str
    side_files: list[Path] = field(default_factory=list)
    layer_kinds: list[str] = field(default_factory=list)
    trace_seconds: float = 0.0  # building the graph (importing onnx_ir included)
    write_seconds: float = 0.0  # streaming the weights into the data file (from the start, at the same time)
    cache_layers: list[int] = field(default_factory=list)  # decode graphs: the layers with a KV cache (GQA)


def describe_caches(result: HfExportResult) -> str:
    """'KV caches (layer: KV heads): 0: 2, 2: 1, 5: 4' for a decode export (heads may differ per layer)."""
    if not result.cache_layers:
        return "no KV cache (no softmax attention)"
    pairs = ", ".join(f"{i}: {result.config.layers[i].kv_heads}" for i in result.cache_layers)
    return f"KV caches (layer: KV heads): {pairs}"


def export_hf(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str | None = None,
    opset: int | None = None,
    decode: bool = False,
    log: Callable[[str], None] = lambda message: None,
) -> HfExportResult:
    """Export the checkpoint in `folder` to `output` (+ `<output>.data` and the side files beside it).

    `dtype` (float32 | float16 | bfloat16) defaults to the checkpoint's torch_dtype. `decode` writes the
    KV-cache decode graph of exporters/decode.py's interface instead (float32; one cache per
    softmax-attention layer, with that layer's KV heads; exporters.hf.decode_graph). Raises UserError for
    bad input before anything is written. Neither export imports torch.
    """
    start = time.perf_counter()
    folder, output = Path(folder), Path(output)
    if decode and dtype not in (None, "float32"):
        raise UserError(f"--decode writes float32 graphs (float32 KV cache); drop --dtype {dtype}")
    if opset is not None and opset not in GRAPH_OPSETS:
        first, last = GRAPH_OPSETS[0], GRAPH_OPSETS[-1]
        raise UserError(f"--opset {opset}: the --hf graph is written at opset {first} to {last}")
    config, sources, dtype = check_folder(folder, "float32" if decode else dtype)
    spec = decode_spec(config, torch_model=False) if decode else None
    kind = "the decode graph of " if decode else ""
    log(f"exporting {kind}{folder} to {output} ({dtype}; weights streamed from the safetensors) ...")
    placements = place_weights(sources, ITEMSIZE[dtype])
    stop = threading.Event()
    if any(converts(s.entry, dtype) for s in sources.values()):
        import_converters()
    with staged_output(output) as staging, ThreadPoolExecutor(max_workers=1) as pool:
        staged = staging / output.name
        # The weights' names and places come from config.json and the safetensors headers alone, so the
        # copy starts first and runs (in the kernel, without the GIL) while the graph is built.
        writing = pool.submit(
            write_data, staged.with_name(f"{staged.name}.data"), sources, placements, dtype, stop
        )
        try:
            built = time.perf_counter()
            onnx_model = build_graph(config, spec, sources, dtype, opset)
            trace_seconds = time.perf_counter() - built
            onnx_model.metadata_props[HF_METADATA_KEY] = json.dumps(describe(config, folder, dtype))
            attach_weights(onnx_model, placements, staged, dtype)
            write_seconds = writing.result()
        except BaseException:
            stop.set()  # the writer stops after its current tensor; the staging folder is removed
            raise
        _save(onnx_model, staged)
        side = [staging / n for n in SIDE_FILES if (folder / n).is_file()]
        for path in side:
            shutil.copyfile(folder / path.name, path)
        for path in side:
            os.replace(path, output.parent / path.name)
        commit_output(staged, output)
    files = [output, output.with_name(f"{output.name}.data")]
    return HfExportResult(
        path=output,
        files=files,
        bytes=sum(f.stat().st_size for f in files),
        seconds=time.perf_counter() - start,
        parameters=sum(math.prod(s.shape) for s in {s.entry.name: s for s in sources.values()}.values()),
        opset=onnx_model.opset_imports.get("", 0),
        attention=config.attention_flags,
        config=config,
        dtype=dtype,
        side_files=[output.parent / p.name for p in side],
        layer_kinds=layer_kinds(config),
        trace_seconds=trace_seconds,
        write_seconds=write_seconds,
        cache_layers=spec.cache_layers if spec is not None else [],
    )


def build_graph(
    config: HfConfig,
    spec: DecodeSpec | None,
    sources: dict[str, WeightSource],
    dtype: str,
    opset: int | None,
) -> ir.Model:
    """The graph with value-less weights, built with onnx-ir: the decode graph for a `spec`, else the
    prefill graph. Its weights must be the source tensors, shape for shape."""
    if spec is None:
        from exporters.hf.prefill_graph import build_prefill  # noqa: PLC0415 (onnx_ir: ~1 s to import; the weight copy starts before it loads)

        model = build_prefill(config, dtype, opset)
    else:
        from exporters.hf.decode_graph import build_decode  # noqa: PLC0415 (onnx_ir: ~1 s to import; the weight copy starts before it loads)

        model = build_decode(config, spec, opset)
    _check_weights(model, sources)
    return model


def _check_weights(model: ir.Model, sources: dict[str, WeightSource]) -> None:
    """The graph's weights and the config-derived tensor list must agree (a bug otherwise, not bad input)."""
    for name, value in model.graph.initializers.items():
        source = sources.get(name)
        if value.const_value is None and (source is None or tuple(value.shape) != source.shape):
            raise RuntimeError(
                f"internal error: graph weight {name!r} {list(value.shape)} does not match "
                "exporters.hf.config.expected_tensors"
            )


def _save(model: ir.Model, path: Path) -> None:
    import onnx_ir as ir  # noqa: PLC0415 (loaded by build_graph already; see there why not at the top)

    ir.save(model, path)


def describe(config: HfConfig, folder: Path, dtype: str) -> dict:
    """The graph's metadata: source architecture, per-layer kinds and names, and block_configs."""
    return {
        "format": "ffn-fusion-hf/1",
        "architecture": config.architecture,
        "model_type": config.model_type,
        "dtype": dtype,
        "source": folder.resolve().name,
        "layer_names": [f"model.layers.{i}" for i in range(len(config.layers))],
        "layer_kinds": layer_kinds(config),
        "block_configs": config.raw.get("block_configs"),
    }

