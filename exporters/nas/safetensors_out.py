"""Sharded safetensors written tensor by tensor, chunk by chunk, from tensors that are never whole in memory.

Every tensor's place is known before a byte is written (shapes and dtypes from the layout), so each shard's
header goes first and each tensor is written at its offset: by a kernel copy (copy_file_range) when its
bytes are a range of the ONNX data file in the output dtype, else in bands of rows converted with numpy
(rounding to nearest even, as torch's `.to(dtype)`), so that memory holds one band whatever the model size.

The safetensors layout: an 8-byte little-endian header length, the JSON header {name: {dtype, shape,
data_offsets}} padded with spaces to a multiple of 8, then the tensors back to back in header order.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from passes.io.file_copy import copy_range, write_at

if TYPE_CHECKING:  # numpy (and onnx_ir, through the layout) stay out of the early copy's thread (early_copy)
    import numpy as np

    from exporters.nas.layout import TensorSource

SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
# The bytes of 1.0 (a "fold" layer's norm weight), little-endian.
ONE = {"float32": struct.pack("<f", 1.0), "float16": struct.pack("<e", 1.0), "bfloat16": b"\x80\x3f"}
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20  # float32 bytes of one band of rows converted at a time
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the output: its name, dtype, shape, and how to write its bytes at an offset of a file."""

    name: str
    dtype: str  # a key of SAFETENSORS_DTYPES
    shape: tuple[int, ...]
    write: Callable[[int, int], int]  # (fd, offset) -> writes `nbytes` there and returns the count
    # ("copy", file, offset, length) or ("fill", value) when the bytes are a file range or a constant:
    # what exporters.nas.early_copy compares its guess with.
    origin: tuple | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def band_rows(cols: int, itemsize: int = 4) -> int:
    """Rows per band so that one band holds about CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // max(1, cols * itemsize))


def write_bands(fd: int, offset: int, bands: Iterator[np.ndarray]) -> int:
    """Write each band's bytes one after the other from `offset`; returns the bytes written."""
    import numpy as np  # noqa: PLC0415 (loaded by then: only the main thread's writers convert)

    written = 0
    for band in bands:
        data = np.ascontiguousarray(band)
        write_at(fd, data.view(np.uint8).reshape(-1), offset + written)
        written += data.nbytes
    return written


def range_copy(path: str, start: int, length: int) -> Callable[[int, int], int]:
    """A writer of `length` bytes at `start` of `path` into (fd, offset), copied in the kernel; both output
    formats (safetensors, GGUF) copy a weight whose bytes are already right this way."""

    def write(fd: int, offset: int) -> int:
        source = os.open(path, os.O_RDONLY)
        try:
            copy_range(source, start, fd, offset, length, name=path)
        finally:
            os.close(source)
        return length

    return write


def copied(name: str, dtype: str, shape: tuple[int, ...], path: str, start: int, length: int) -> OutTensor:
    """A tensor whose bytes are `length` bytes at `start` of `path`: copied in the kernel."""
    path = os.path.realpath(path)
    return OutTensor(name, dtype, shape, range_copy(path, start, length), ("copy", path, start, length))


def in_memory(name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> OutTensor:
    """A small tensor whose bytes are given (an initializer stored inside the ONNX file)."""

    def write(fd: int, offset: int) -> int:
        write_at(fd, data, offset)
        return len(data)

    return OutTensor(name, dtype, shape, write, ("bytes", data))


def filled_with_ones(name: str, dtype: str, shape: tuple[int, ...]) -> OutTensor:
    """A tensor of ones (float32, float16 or bfloat16)."""
    data = ONE[dtype] * math.prod(shape)
    def write(fd: int, offset: int) -> int:
        write_at(fd, data, offset)
        return len(data)

    return OutTensor(name, dtype, shape, write, ("fill", 1.0))


def plan_shards(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Tensors in order, a new shard whenever the next one would pass `max_bytes` (a larger tensor gets a
    shard of its own), as save_pretrained shards."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def header_bytes(tensors: list[OutTensor]) -> tuple[bytes, list[int]]:
    """The shard's header (length prefix included) and each tensor's offset in the file."""
    header: dict = {"__metadata__": {"format": "pt"}}
    begin, offsets = 0, []
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [begin, begin + tensor.nbytes],
        }
        offsets.append(begin)
        begin += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, [base + o for o in offsets]


def write_checkpoint(
    folder: Path, tensors: list[OutTensor], max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    log: Callable[[str], None] = lambda message: None, stop: threading.Event | None = None,
) -> list[Path]:
    """Write `tensors` as sharded safetensors (+ the index when there are several shards) into `folder`;
    returns the files written. Returns early (files incomplete) once `stop` is set."""
    shards = plan_shards(tensors, max_shard_bytes)
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    files = []
    sources = _Sources()
    try:
        for name, shard in zip(names, shards, strict=True):
            path = folder / name
            header, offsets = header_bytes(shard)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_at(fd, header, 0)
                for run in _runs(shard, offsets):
                    if not _write_run(run, fd, sources, stop):
                        return files
                    weight_map.update(dict.fromkeys((t.name for t in run.tensors), name))
                os.ftruncate(fd, offsets[-1] + shard[-1].nbytes if shard else len(header))
            finally:
                os.close(fd)
            files.append(path)
            log(f"  {name}: {len(shard)} tensors, {path.stat().st_size / 2**20:.1f} MiB")
    finally:
        sources.close()
    if len(shards) > 1:
        total = sum(t.nbytes for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(folder / INDEX_FILE)
    return files


# Bytes of one copy_file_range call at most: a stop request waits for one call, and a thread copying while
# the main thread runs Python takes the GIL back once per call (up to sys.getswitchinterval(), 5 ms, each).
RUN_CALL_BYTES = 256 << 20


@dataclass
class _Run:
    """Tensors back to back in a shard: one kernel copy when all are copies of one contiguous file range
    (`source` = (path, start)), else a single tensor written by its own writer."""

    tensors: list[OutTensor]
    at: int  # offset in the shard
    source: tuple[str, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _runs(shard: list[OutTensor], offsets: list[int]) -> list[_Run]:
    """The shard's tensors grouped into runs: a tensor copied from the bytes right after the previous
    tensor's source, to the bytes right after its output (always, here; not where a GGUF file pads a
    tensor, exporters.nas.gguf_out), joins its run. The fused graph's data file holds most tensors in
    checkpoint order, so a 5 GB shard is a handful of copies instead of one open, copy and close per
    tensor."""
    runs: list[_Run] = []
    for tensor, at in zip(shard, offsets, strict=True):
        origin = tensor.origin
        copy = origin is not None and origin[0] == "copy" and origin[3] == tensor.nbytes
        last = runs[-1] if runs else None
        if copy and last is not None and last.source is not None and last.source[0] == origin[1] and (
            last.source[1] + last.nbytes == origin[2] and last.at + last.nbytes == at
        ):
            last.tensors.append(tensor)
        else:
            runs.append(_Run([tensor], at, (origin[1], origin[2]) if copy else None))
    return runs


class _Sources:
    """Source files opened once for all the copies of a write."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def open(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _write_run(run: _Run, fd: int, sources: _Sources, stop: threading.Event | None) -> bool:
    """Write one run at its offset; False when `stop` was set first (nothing more is written)."""
    if run.source is None:
        tensor = run.tensors[0]
        if stop is not None and stop.is_set():
            return False
        if (written := tensor.write(fd, run.at)) != tensor.nbytes:
            raise RuntimeError(f"internal error: {tensor.name}: {written} of {tensor.nbytes} bytes")
        return True
    path, start = run.source
    source, total = sources.open(path), run.nbytes
    for done in range(0, total, RUN_CALL_BYTES):
        if stop is not None and stop.is_set():
            return False
        copy_range(source, start + done, fd, run.at + done, min(RUN_CALL_BYTES, total - done), name=path)
    return True


INLINE_BYTES = 1 << 20  # an initializer inside the ONNX file (a norm weight) is written from memory whole


def out_tensor(source: TensorSource, dtype: str) -> OutTensor:
    """The writer of one tensor in `dtype`: a kernel copy when the ONNX holds its bytes as they are, else
    bands of rows converted through float32 (round to nearest even)."""
    import ml_dtypes  # noqa: PLC0415 (numpy loads only once the layout is known: see TYPE_CHECKING above)
    import numpy as np  # noqa: PLC0415 (numpy loads only once the layout is known)

    numpy_dtypes = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    if source.tensor is None and source.fill == 1.0:
        return filled_with_ones(source.name, dtype, source.shape)
    stored = source.tensor.dtype.numpy() if source.tensor is not None else None
    same = stored is not None and np.dtype(stored) == np.dtype(numpy_dtypes[dtype])
    if source.kernel_copyable and same:
        return copied(source.name, dtype, source.shape, *source.byte_range())
    if same and source.tensor.nbytes <= INLINE_BYTES and not source.transpose and source.rows is None:
        return in_memory(source.name, dtype, source.shape, source.tensor.tobytes())

    def write(fd: int, offset: int) -> int:
        step = band_rows(source.shape[-1])
        target = numpy_dtypes[dtype]
        bands = (
            source.read(first, min(first + step, source.height)).astype(np.float32, copy=False).astype(target)
            for first in range(0, source.height, step)
        )
        return write_bands(fd, offset, bands)

    return OutTensor(source.name, dtype, source.shape, write)
