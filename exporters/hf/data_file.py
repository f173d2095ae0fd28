"""The exported model's `<model>.data`: where each weight lies, its streamed writing, the graph's references.

    placements = place_weights(sources, itemsize)              # from the safetensors headers alone
    write_data(data_path, sources, placements, dtype, stop)    # a second thread, straight from the shards
    attach_weights(model, placements, onnx_path, dtype)        # value-less initializers -> external data

Weights keep the checkpoint's file order at page-aligned offsets, so the writer starts before the graph
exists: kernel copies (copy_file_range, one per run of tensors that lie back to back in shard and data
file) when the dtype is kept, exporters.hf.dtype_convert's row chunks when it changes. Standard library
only at import time (onnx_ir is loaded only by attach_weights, once the copy runs).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from exporters.hf.dtype_convert import convert_rows, converts
from exporters.hf.safetensors_in import TensorEntry
from exporters.hf.weight_sources import WeightSource
from passes.errors import UserError
from passes.io.file_copy import copy_range

if TYPE_CHECKING:
    import onnx_ir as ir

ALIGNMENT = 4096  # external data offsets (page-aligned, so runtimes can memory-map each tensor)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Placement:
    """Where a weight lies in the data file."""

    offset: int
    length: int


def place_weights(sources: dict[str, WeightSource], itemsize: int) -> dict[str, Placement]:
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
class CopyRun:
    """A piece of the data file: bytes copied as they are from `file`, or one tensor to convert."""

    file: Path
    start: int  # byte range in the shard
    length: int  # bytes written to the data file
    offset: int  # where in the data file
    convert: TensorEntry | None = None


def copy_runs(
    sources: dict[str, WeightSource], placements: dict[str, Placement], dtype: str
) -> list[CopyRun]:
    """The data file's pieces in order. Tensors that lie back to back both in their shard and in the data
    file (sizes that are multiples of the alignment, as in most checkpoints) become one kernel copy: the
    writer thread then needs the GIL, which the graph builder holds most of the time, a few times per
    shard instead of once per tensor."""
    runs: list[CopyRun] = []
    seen: set[Placement] = set()
    for name, placement in sorted(placements.items(), key=lambda kv: kv[1].offset):
        if placement in seen:
            continue
        seen.add(placement)
        entry = sources[name].entry
        last = runs[-1] if runs else None
        if converts(entry, dtype):
            runs.append(CopyRun(entry.file, entry.start, placement.length, placement.offset, entry))
        elif (
            last is not None
            and last.convert is None
            and last.file == entry.file
            and last.start + last.length == entry.start
            and last.offset + last.length == placement.offset
        ):
            last.length += placement.length
        else:
            runs.append(CopyRun(entry.file, entry.start, placement.length, placement.offset))
    return runs


def write_data(
    data_path: Path,
    sources: dict[str, WeightSource],
    placements: dict[str, Placement],
    dtype: str,
    stop: threading.Event | None = None,
) -> float:
    """Write every weight at its place in `dtype`, straight from the shards (copy_runs); returns the
    seconds it took. Returns early (the file incomplete) once `stop` is set: the export failed elsewhere."""
    start = time.perf_counter()
    end = max((p.offset + p.length for p in placements.values()), default=0)
    shards: dict[Path, int] = {}
    fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for run in copy_runs(sources, placements, dtype):
            if stop is not None and stop.is_set():
                return time.perf_counter() - start
            if run.file not in shards:
                shards[run.file] = os.open(run.file, os.O_RDONLY)
            if run.convert is None:
                copy_range(shards[run.file], run.start, fd, run.offset, run.length, name=str(run.file))
            else:
                written = convert_rows(shards[run.file], run.convert, fd, run.offset, dtype)
                if written != run.length:
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
    import onnx_ir as ir  # noqa: PLC0415 (onnx_ir: ~1-1.5 s to import; the copy starts before it loads)

    from exporters.hf.prefill_graph import IR_DTYPES  # noqa: PLC0415 (loads onnx_ir: as above)

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
