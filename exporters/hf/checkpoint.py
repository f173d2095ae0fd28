"""Export a Hugging Face checkpoint folder to ONNX without holding its weights in memory.

    export_hf(folder, "out/model.onnx", dtype=None)  ->  out/model.onnx + model.onnx.data + config.json, ...

How (see docs/export.md, "Hugging Face checkpoints"):

1. config.json is read into per-layer shapes (exporters.hf.config) and the safetensors headers (one file or
   shards listed by model.safetensors.index.json) into a table name -> file, dtype, shape, byte range.
   Every tensor the model needs is checked against that table before anything is written.
2. Each weight gets a page-aligned place in `<model>.data`, known from step 1 alone, so a second thread
   starts writing the data file at once, straight from the shards: kernel copies (copy_file_range, one per
   run of tensors that lie back to back in shard and data file) when the dtype is kept, row chunks
   converted with numpy when it changes. Peak memory stays at the graph plus one chunk.
3. Meanwhile the prefill graph is built directly with onnx-ir from the config (exporters.hf.graph, no
   torch, a fraction of a second): every weight is an initializer named as its checkpoint tensor, with a
   shape and no value (linear weights stay [out, in], read through Transpose). The --decode graph is
   traced from exporters/decode.py's torch model on the meta device (exporters.hf.model) with
   torch.onnx.export(dynamo=True); its parameters become value-less initializers the same way.
4. Each value-less initializer becomes an external-data reference to its place in `<model>.data`.

Everything is written into a staging folder beside the output and moved into place at the end, so a
failed export leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from exporters.export_record import ExportResult
from exporters.hf.config import DTYPES, HfConfig, decode_spec, expected_tensors, layer_kinds, read_config
from passes.errors import UserError
from passes.io.file_copy import copy_range, write_at
from passes.io.staging import commit_output, staged_output

if TYPE_CHECKING:  # onnx_ir (~1.5 s to import) and torch (--decode only) load once the weight copy runs
    import numpy as np
    import onnx_ir as ir

    from exporters.decode_spec import DecodeSpec
    from exporters.hf import model as hf_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
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
METADATA_KEY = "ffn_fusion.hf"
ALIGNMENT = 4096  # external data offsets (page-aligned, so runtimes can memory-map each tensor)
CHUNK_BYTES = 64 << 20  # rows converted at a time when the dtype changes
# Tensors some checkpoints carry that no computation reads.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# exporters.hf.graph's ops mean the same from opset 18 (ReduceMean's axes as an input) to 23.
PREFILL_OPSETS = range(18, 24)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype, shape and absolute byte range in `file`."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class Checkpoint:
    """The tensor table of a checkpoint folder, read from the safetensors headers only."""

    folder: Path
    tensors: dict[str, TensorEntry] = field(default_factory=dict)

    @property
    def largest_bytes(self) -> int:
        return max((t.end - t.start for t in self.tensors.values()), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Read the safetensors headers (index + shards, or model.safetensors); UserError for a missing shard."""
    folder = Path(folder)
    checkpoint = Checkpoint(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{index}: cannot read 'weight_map' ({type(exc).__name__})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (folder / name).is_file():
                raise UserError(f"{index}: shard {name!r} (field 'weight_map') is missing from {folder}")
        for name in files:
            checkpoint.tensors.update(read_header(folder / name))
        for tensor, name in weight_map.items():
            if tensor not in checkpoint.tensors or checkpoint.tensors[tensor].file.name != name:
                raise UserError(f"{index}: 'weight_map' puts {tensor!r} in {name}, which does not hold it")
    elif (folder / SINGLE_FILE).is_file():
        checkpoint.tensors = read_header(folder / SINGLE_FILE)
    else:
        raise UserError(
            f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}; save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    return checkpoint


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The safetensors header: 8-byte little-endian length, JSON {name: {dtype, shape, data_offsets}}."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if length > size - 8:
            raise UserError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: not a safetensors file (bad header)") from None
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if base + end > size:
            raise UserError(f"{path}: tensor {name!r} lies past the end of the file (truncated shard)")
        tensors[name] = TensorEntry(name, path, info["dtype"], tuple(info["shape"]), base + begin, base + end)
    return tensors


@dataclass(frozen=True)
class WeightSource:
    """Where an initializer's bytes come from."""

    initializer: str
    entry: TensorEntry
    shape: tuple[int, ...]


def plan_weights(config: HfConfig, checkpoint: Checkpoint) -> dict[str, WeightSource]:
    """Map each tensor the model reads to the checkpoint tensor that fills it, checking every shape.

    A tied lm_head is also listed under "lm_head.weight" (the exporter may name the shared initializer
    either way). Raises UserError for a missing tensor, a shape that contradicts config.json, or a tensor
    that config.json has no place for.
    """
    sources: dict[str, WeightSource] = {}
    for name, (shape, config_field) in expected_tensors(config).items():
        entry = checkpoint.tensors.get(name)
        if entry is None:
            raise UserError(
                f"{checkpoint.folder}: tensor {name!r} is missing from the checkpoint "
                f"(config.json field {config_field})"
            )
        if entry.shape != shape:
            raise UserError(
                f"{entry.file}: tensor {name!r} has shape {list(entry.shape)} but config.json "
                f"(field {config_field}) gives {list(shape)}"
            )
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise UserError(
                f"{entry.file}: tensor {name!r} has dtype {entry.dtype}; "
                f"expected one of {', '.join(_SAFETENSORS_DTYPES)}"
            )
        sources[name] = WeightSource(name, entry, shape)
    if config.tie_embeddings:
        embedding = sources["model.embed_tokens.weight"]
        sources["lm_head.weight"] = WeightSource("lm_head.weight", embedding.entry, embedding.shape)
    used = {s.entry.name for s in sources.values()}
    dropped = _dropped_attention_tensors(config)
    for name, entry in checkpoint.tensors.items():
        if name not in used and name not in dropped and not name.endswith(IGNORED_SUFFIXES):
            if name == "lm_head.weight" and config.tie_embeddings:
                continue  # some tied checkpoints store the copy too; the embedding is the one read
            raise UserError(
                f"{entry.file}: tensor {name!r} has no place in the model config.json describes "
                f"(field {_field_of(config, name)})"
            )
    return sources


def _dropped_attention_tensors(config: HfConfig) -> set[str]:
    """Attention tensors of layers whose attention exporters.hf.folder dropped (o_proj zero): unused."""
    dropped = config.raw.get("ffn_fusion_dropped_attention") or []
    names = {"input_layernorm.weight"} | {
        f"self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")
    }
    return {f"model.layers.{i}.{n}" for i in dropped for n in names}


def _field_of(config: HfConfig, name: str) -> str:
    """The config.json field that sets this tensor's shape or presence."""
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) < len(config.layers):
        layer = config.layers[int(parts[2])]
        if parts[3] in ("mlp", "post_attention_layernorm"):
            return layer.ffn_field if config.is_deci else "intermediate_size"
        if parts[3] in ("self_attn", "input_layernorm"):
            return layer.attention_field if config.is_deci else "num_key_value_heads, head_dim"
        return "num_hidden_layers"
    if parts[0] == "lm_head" or "embed_tokens" in name:
        return "vocab_size, hidden_size, tie_word_embeddings"
    if len(parts) > 2 and parts[1] == "layers":
        return "num_hidden_layers" if not config.is_deci else "block_configs"
    return "hidden_size"


# ------------------------------------------------------------------------------------------- export


@dataclass(kw_only=True)
class HfExportResult(ExportResult):
    """What `export_hf` wrote: exporters.onnx_export.ExportResult, and the checkpoint's config and dtype."""

    config: HfConfig
    dtype: str
    side_files: list[Path] = field(default_factory=list)
    layer_kinds: list[str] = field(default_factory=list)
    trace_seconds: float = 0.0  # building the graph (for --decode: importing torch, tracing, optimizing)
    write_seconds: float = 0.0  # streaming the weights into the data file (from the start, at the same time)
    cache_layers: list[int] = field(default_factory=list)  # decode graphs: the layers with a KV cache (GQA)


def describe_caches(result: HfExportResult) -> str:
    """'KV caches (layer: KV heads): 0: 2, 2: 1, 5: 4' for a decode export (heads may differ per layer)."""
    if not result.cache_layers:
        return "no KV cache (no softmax attention)"
    pairs = ", ".join(f"{i}: {result.config.layers[i].kv_heads}" for i in result.cache_layers)
    return f"KV caches (layer: KV heads): {pairs}"


def check_folder(
    folder: str | os.PathLike, dtype: str | None = None
) -> tuple[HfConfig, dict[str, WeightSource], str]:
    """Read and check config.json and the safetensors headers (no torch): config, weight plan, dtype."""
    folder = Path(folder)
    config = read_config(folder)
    dtype = dtype or config.dtype
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return config, plan_weights(config, open_checkpoint(folder)), dtype


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
    KV-cache decode graph of exporters/decode.py instead (float32; one cache per softmax-attention layer,
    with that layer's KV heads; see exporters.hf.config.decode_spec for what it covers). Raises UserError
    for bad input before anything is written. The prefill export never imports torch.
    """
    start = time.perf_counter()
    folder, output = Path(folder), Path(output)
    if decode and dtype not in (None, "float32"):
        raise UserError(f"--decode writes float32 graphs (float32 KV cache); drop --dtype {dtype}")
    if opset is not None and not decode and opset not in PREFILL_OPSETS:
        first, last = PREFILL_OPSETS[0], PREFILL_OPSETS[-1]
        raise UserError(f"--opset {opset}: the --hf graph is written at opset {first} to {last}")
    config, sources, dtype = check_folder(folder, "float32" if decode else dtype)
    spec = decode_spec(config) if decode else None
    kind = "the decode graph of " if decode else ""
    log(f"exporting {kind}{folder} to {output} ({dtype}; weights streamed from the safetensors) ...")
    placements = plan_layout(sources, ITEMSIZE[dtype])
    stop = threading.Event()
    if any(_converts(s.entry, dtype) for s in sources.values()):
        _import_converters()
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
            onnx_model.metadata_props[METADATA_KEY] = json.dumps(describe(config, folder, dtype))
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
    """The graph with value-less weights: the decode graph traced for a `spec`, else the prefill graph
    built with onnx-ir. Its weights must be the planned tensors, shape for shape."""
    if spec is None:
        from exporters.hf.graph import build_prefill

        model = build_prefill(config, dtype, opset)
    else:
        from exporters.hf import model as hf_model

        model = trace(hf_model.decode_traceable(config, spec), opset)
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


def trace(traceable: hf_model.Traceable, opset: int | None) -> ir.Model:
    """The optimized graph of a meta model; weight initializers keep their names and have no value."""
    import onnx_ir as ir
    import torch

    from exporters.hf.model import parameter_aliases
    from exporters.onnx_export import dynamo_export, quiet_export

    parameters = set(parameter_aliases(traceable.model))
    with quiet_export(), torch.no_grad(), _quiet_logger("onnx_ir"):
        program = dynamo_export(
            traceable.model,
            traceable.args,
            opset=opset,
            optimize=False,
            input_names=traceable.input_names,
            output_names=traceable.output_names,
            dynamic_shapes=traceable.dynamic_shapes,
        )
        for name, value in program.model.graph.initializers.items():
            if name in traceable.buffers:
                value.const_value = ir.tensor(traceable.buffers[name], name=name)
            elif name in parameters:
                value.const_value = None  # the optimizer neither reads nor folds a value it does not have
            else:
                raise RuntimeError(f"exported graph has an unexpected initializer {name!r}")
        program.optimize()
    onnx_model = program.model
    traceable.name_dims(onnx_model)
    onnx_model.metadata_props.update(traceable.metadata)
    return onnx_model


def _save(model: ir.Model, path: Path) -> None:
    import onnx_ir as ir

    with _quiet_logger("onnx_ir"):
        ir.save(model, path)


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """onnx-ir warns once per weight that it skips deduplicating value-less initializers: expected here."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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


@dataclass(frozen=True)
class Placement:
    """Where a weight lies in the data file."""

    offset: int
    length: int


def plan_layout(sources: dict[str, WeightSource], itemsize: int) -> dict[str, Placement]:
    """Page-aligned offsets for every weight, in checkpoint file order (sequential reads); a tied lm_head
    shares the embedding's place."""
    placements: dict[str, Placement] = {}
    by_tensor: dict[tuple[Path, str], Placement] = {}
    offset = 0
    for name, source in sorted(sources.items(), key=lambda kv: (str(kv[1].entry.file), kv[1].entry.start)):
        key = (source.entry.file, source.entry.name)
        if key not in by_tensor:
            offset = -(-offset // ALIGNMENT) * ALIGNMENT
            by_tensor[key] = Placement(offset, math.prod(source.shape) * itemsize)
            offset += by_tensor[key].length
        placements[name] = by_tensor[key]
    return placements


@dataclass
class _Run:
    """A piece of the data file: bytes copied as they are from `file`, or one tensor to convert."""

    file: Path
    start: int  # byte range in the shard
    length: int  # bytes written to the data file
    offset: int  # where in the data file
    convert: TensorEntry | None = None


def plan_runs(sources: dict[str, WeightSource], placements: dict[str, Placement], dtype: str) -> list[_Run]:
    """The data file's pieces in order. Tensors that lie back to back both in their shard and in the data
    file (sizes that are multiples of the alignment, as in most checkpoints) become one kernel copy: the
    writer thread then needs the GIL, which the graph builder holds most of the time, a few times per
    shard instead of once per tensor."""
    runs: list[_Run] = []
    seen: set[Placement] = set()
    for name, placement in sorted(placements.items(), key=lambda kv: kv[1].offset):
        if placement in seen:
            continue
        seen.add(placement)
        entry = sources[name].entry
        last = runs[-1] if runs else None
        if _converts(entry, dtype):
            runs.append(_Run(entry.file, entry.start, placement.length, placement.offset, entry))
        elif (
            last is not None
            and last.convert is None
            and last.file == entry.file
            and last.start + last.length == entry.start
            and last.offset + last.length == placement.offset
        ):
            last.length += placement.length
        else:
            runs.append(_Run(entry.file, entry.start, placement.length, placement.offset))
    return runs


def write_data(
    data_path: Path,
    sources: dict[str, WeightSource],
    placements: dict[str, Placement],
    dtype: str,
    stop: threading.Event | None = None,
) -> float:
    """Write every weight at its place in `dtype`, straight from the shards (plan_runs); returns the
    seconds it took. Returns early (the file incomplete) once `stop` is set: the export failed elsewhere."""
    start = time.perf_counter()
    end = max((p.offset + p.length for p in placements.values()), default=0)
    shards: dict[Path, int] = {}
    fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for run in plan_runs(sources, placements, dtype):
            if stop is not None and stop.is_set():
                return time.perf_counter() - start
            if run.file not in shards:
                shards[run.file] = os.open(run.file, os.O_RDONLY)
            if run.convert is None:
                copy_range(shards[run.file], run.start, fd, run.offset, run.length, name=str(run.file))
            elif (written := _convert(shards[run.file], run.convert, fd, run.offset, dtype)) != run.length:
                raise RuntimeError(
                    f"internal error: wrote {written} bytes at {run.offset}, expected {run.length}"
                )
        os.ftruncate(fd, end)
    except OSError as exc:
        raise UserError(f"cannot write {data_path}: {exc.strerror or exc}") from None
    finally:
        for shard in [fd, *shards.values()]:
            os.close(shard)
    return time.perf_counter() - start


def attach_weights(model: ir.Model, placements: dict[str, Placement], path: Path, dtype: str) -> None:
    """Point every value-less initializer (a weight) at its place in `<path>.data`; every place written
    must be read by the graph (a bug otherwise: the data file would carry dead bytes)."""
    import onnx_ir as ir

    from exporters.hf.graph import IR_DTYPES

    data_name = f"{path.name}.data"
    attached: set[Placement] = set()
    for name, value in model.graph.initializers.items():
        if value.const_value is not None:
            continue  # a computed constant, stored inline
        placement = placements.get(name)
        if placement is None:
            raise RuntimeError(f"initializer {name!r} has neither a value nor a checkpoint tensor")
        value.const_value = ir.ExternalTensor(
            data_name,
            placement.offset,
            placement.length,
            IR_DTYPES[dtype],
            shape=ir.Shape(value.shape),
            name=name,
            base_dir=path.parent,
        )
        attached.add(placement)
    unread = sorted(n for n, p in placements.items() if p not in attached)
    if unread:
        raise RuntimeError(f"internal error: the graph reads no initializer for {', '.join(unread[:5])}")


def _converts(entry: TensorEntry, dtype: str) -> bool:
    """The tensor is stored in another dtype than the export's: written through _convert, not copied."""
    return _SAFETENSORS_DTYPES[entry.dtype] != dtype


def _import_converters() -> None:
    """Import numpy and ml_dtypes (which converting needs) in this thread before the writer starts: the
    main thread imports numpy too (through onnx_ir), and two threads importing numpy for the first time
    at once can get it half initialized ("cannot import name '__cpu_features__' from partially initialized
    module"; seen in CI)."""
    import ml_dtypes  # noqa: F401
    import numpy  # noqa: F401


def _convert(src: int, entry: TensorEntry, fd: int, offset: int, dtype: str) -> int:
    """Convert in row chunks read from the shard with numpy and ml_dtypes (bfloat16; onnx loads it anyway):
    every cast goes through float32 and rounds to nearest even, as torch's `.to(dtype)` does."""
    import ml_dtypes
    import numpy as np

    numpy_dtypes = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    source, target = numpy_dtypes[_SAFETENSORS_DTYPES[entry.dtype]], numpy_dtypes[dtype]
    length = entry.end - entry.start
    rows = entry.shape[0] if entry.shape else 1
    row_bytes = max(1, length // max(rows, 1))
    step = max(1, CHUNK_BYTES // row_bytes) * row_bytes
    written = 0
    for first in range(0, length, step):
        raw = os.pread(src, min(step, length - first), entry.start + first)
        data = np.frombuffer(raw, dtype=source).astype(target)
        write_at(fd, data.view(np.uint8), offset + written)
        written += data.nbytes
    return written


def read_tensor_rows(entry: TensorEntry, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of a checkpoint tensor (a vector is one row), in its own dtype, read from the shard."""
    import ml_dtypes
    import numpy as np

    numpy_dtypes = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    dtype = np.dtype(numpy_dtypes[_SAFETENSORS_DTYPES[entry.dtype]])
    cols = entry.shape[-1] if len(entry.shape) == 2 else math.prod(entry.shape)
    row_bytes = cols * dtype.itemsize
    with open(entry.file, "rb") as f:
        f.seek(entry.start + start * row_bytes)
        raw = f.read((stop - start) * row_bytes)
    return np.frombuffer(raw, dtype=dtype).reshape(stop - start, cols)
