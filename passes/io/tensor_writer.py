"""Writing a model's tensors into its data files: every tensor's byte range written by jobs on two threads.

`write_files` allocates each file's range (fallocate), then runs the jobs of every tensor, each writing its
own byte range at its offset (copy_file_range, sendfile or pwrite), interleaved so that each tensor (and
each file) advances in proportion to its size: one thread copies plain weights in the kernel while the
other builds the next chunk of a fused weight (passes/io/stream_concat.py: a tensor with a `writes(fd, at)`
method yields its own jobs). One write at a time to a file (the kernel serializes writes to a file anyway;
see _writing), so a thread builds a chunk while the other writes. A thread builds its chunks in its chunk
buffer (`chunk_buffer`), the pages of a memfd written by one sendfile.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import errno
import functools
import heapq
import io
import itertools
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import onnx_ir as ir

from passes.io.file_copy import WRITE_BYTES, copy_range

IOV_MAX = 1024  # buffers one preadv/pwritev call takes (Linux)
BUFFER_BYTES = 4 << 20  # a thread's chunk buffer at least (stream_concat.CHUNK_BYTES, a built chunk)


@dataclass(frozen=True)
class Write:
    """A job writing its own `nbytes` of an output file: runs on any thread, in any order."""

    nbytes: int
    run: Callable[[], None]


_THREAD = threading.local()


class _ChunkBuffer:
    """A thread's buffer for the chunk it builds, written into the output by one system call: the pages of a
    memfd (a file in memory), which sendfile copies into the output file in the kernel, 64 KB at a time as
    `cp` copies. The gathering pwritev calls it replaces wrote at most WRITE_BYTES each, and each paid a
    return to Python and a hand-off of the interpreter lock between the two threads (with the Python
    that built their buffer lists, 20-25% of a fusion's CPU time on two cores; docs/scale.md, eighth pass).
    Without memfd (not Linux, or refused by a sandbox's system-call filter), or where sendfile refuses the
    output, plain memory written with pwritev."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        try:
            self.fd: int | None = os.memfd_create("ffn-fusion-chunk")
        except (AttributeError, OSError):
            self.fd = None
        if self.fd is None:
            self.memory: mmap.mmap | bytearray = bytearray(nbytes)
            return
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, nbytes)
        self.memory = mmap.mmap(self.fd, nbytes)

    def array(self, rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
        return np.frombuffer(self.memory, dtype, rows * cols).reshape(rows, cols)

    def write(self, fd: int, nbytes: int, at: int) -> None:
        """Its first `nbytes` into `fd` at `at`."""
        sent = 0
        if self.fd is not None:
            with _writing(fd):  # sendfile writes at the file's position: one writer at a time moves it
                os.lseek(fd, at, os.SEEK_SET)
                try:
                    while sent < nbytes:
                        count = os.sendfile(fd, self.fd, sent, nbytes - sent)
                        if count == 0:
                            raise OSError(errno.EIO, f"sendfile stopped at {sent} of {nbytes} bytes")
                        sent += count
                except OSError as error:
                    if error.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
        if sent < nbytes:
            pwrite_all(fd, [np.frombuffer(self.memory, np.uint8, nbytes - sent, sent)], at + sent)


def chunk_buffer(nbytes: int) -> _ChunkBuffer:
    """The calling thread's chunk buffer, at least `nbytes` large, reused from chunk to chunk (new memory
    per chunk cost a page fault for every 4 KB, slow on this VM: docs/scale.md, eighth pass)."""
    buffer = _THREAD.__dict__.get("chunk")
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _THREAD.chunk = _ChunkBuffer(max(nbytes, BUFFER_BYTES))
    return buffer


_WORKERS = 2  # threads running write jobs (preadv, ONNX Runtime, numpy and the kernel copies release the GIL)
COPY_BYTES = 8 << 20  # bytes per kernel-copy job


def write_tensors(file, tensors: Sequence[ir.TensorProtocol]) -> list[int]:
    """Write the tensors' bytes one after the other from the file's position; the offset of each (see
    write_files)."""
    return write_files([(file, tensors)])[0]


def write_files(files: Sequence[tuple[BinaryIO, Sequence[ir.TensorProtocol]]]) -> list[list[int]]:
    """Write each file's tensors one after the other from its position; the offsets of each file's tensors.

    Into regular files, all at once: each file's range is allocated (fallocate), and the jobs of every
    tensor (a ConcatTensor's chunks and kernel copies, an external tensor's kernel copies in COPY_BYTES
    pieces, any other tensor whole) run on two threads, interleaved so that each tensor advances in
    proportion to its size. So one thread copies plain weights (down, the layers not fused) in the kernel
    while the other scales the next gate/up rows, where written tensor after tensor the scaling waited for
    the copies and the copies for the scaling. The files are interleaved the same way, so that the two
    threads mostly write different files: the kernel serializes writes to one file, not to two (_writing).
    Into a stream: tensor after tensor, with `tofile`."""
    offsets = [
        list(itertools.accumulate((t.nbytes for t in tensors), initial=file.tell()))
        for file, tensors in files
    ]
    streams, sizes = [], []
    for (file, tensors), ends in zip(files, offsets, strict=True):
        fd = regular_fd(file)
        if fd is None:
            for tensor, offset in zip(tensors, ends[:-1], strict=True):
                tensor.tofile(file)
                _check_length(tensor, file.tell() - offset)
            continue
        file.flush()
        _allocate(fd, ends[0], ends[-1] - ends[0])
        jobs = [_tensor_writes(tensor, fd, at) for tensor, at in zip(tensors, ends[:-1], strict=True)]
        streams.append(_interleaved(jobs, [tensor.nbytes for tensor in tensors]))
        sizes.append(ends[-1] - ends[0])
    _run(_interleaved(streams, sizes))
    for (file, _), ends in zip(files, offsets, strict=True):
        file.seek(ends[-1])
    return [ends[:-1] for ends in offsets]


def _tensor_writes(tensor: ir.TensorProtocol, fd: int, at: int) -> Iterator[Write]:
    writes = getattr(tensor, "writes", None)  # writes itself in jobs: stream_concat.ConcatTensor
    if writes is not None:
        yield from writes(fd, at)
    elif isinstance(tensor, ir.ExternalTensor):
        yield from copies(str(tensor.path), tensor.offset or 0, tensor.nbytes, fd, at)
    elif tensor.nbytes:
        yield Write(tensor.nbytes, functools.partial(_write_whole, tensor, fd, at))


def copies(path: str, offset: int, length: int, fd: int, at: int) -> Iterator[Write]:
    """Kernel copies of a file range, COPY_BYTES a job (several jobs, so that both threads copy)."""
    for done in range(0, length, COPY_BYTES):
        count = min(COPY_BYTES, length - done)
        yield Write(count, functools.partial(_copy_file, path, offset + done, fd, at + done, count))


def _interleaved(streams: list[Iterator[Write]], sizes: list[int]) -> Iterator[Write]:
    """The jobs of all streams, next from the stream least far along (bytes given over its size)."""
    heap = [(0.0, i) for i, size in enumerate(sizes) if size]
    done = [0] * len(sizes)
    while heap:
        _, i = heapq.heappop(heap)
        job = next(streams[i], None)
        if job is not None:
            yield job
            done[i] += job.nbytes
            heapq.heappush(heap, (done[i] / sizes[i], i))


class _WriterAt:
    """A file-like `write` for `tofile`: pwrite from `at` of `fd` onwards (one per job, no shared seek)."""

    def __init__(self, fd: int, at: int) -> None:
        self.fd, self.at = fd, at

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        pwrite_all(self.fd, [np.frombuffer(view, np.uint8)], self.at)
        self.at += len(view)
        return len(view)


def _write_whole(tensor: ir.TensorProtocol, fd: int, at: int) -> None:
    writer = _WriterAt(fd, at)
    tensor.tofile(writer)
    _check_length(tensor, writer.at - at)


def _check_length(tensor: ir.TensorProtocol, length: int) -> None:
    if length != tensor.nbytes:
        raise ValueError(f"{tensor.name}: wrote {length} bytes for a tensor of {tensor.nbytes}")


def _run(jobs: Iterator[Write]) -> None:
    """Run `jobs` on _WORKERS threads, a few queued at a time (each job holds only its own chunk)."""
    pending: collections.deque = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
        try:
            for job in jobs:
                pending.append(pool.submit(job.run))
                if len(pending) > 2 * _WORKERS:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def write_chunk(file, chunk: np.ndarray) -> None:
    file.write(memoryview(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)))


# One write at a time to a file. A write holds the file's inode lock in the kernel, and a second thread
# writing the same file spins on that lock for as long as the first is copying (rwsem_spin_on_owner was a
# quarter of a "fold"'s CPU time in `perf`): waiting here it sleeps instead, and its core reads and scales
# the next chunk. Writes to different files go on at the same time.
_WRITE_LOCKS: dict[int, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def _writing(fd: int) -> threading.Lock:
    """The lock held while writing to `fd` (a file's descriptor numbers are unique while it is open)."""
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(fd, threading.Lock())


def pwrite_all(fd: int, arrays: list[np.ndarray], offset: int) -> None:
    """Write the arrays' bytes one after the other at `offset` (pwritev, at most WRITE_BYTES and IOV_MAX
    buffers a call)."""
    buffers = [memoryview(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) for a in arrays if a.size]
    with _writing(fd):
        for batch in _calls(buffers):
            while batch:
                count = os.pwritev(fd, batch, offset)
                offset += count
                batch = advance(batch, count)


def _calls(buffers: list[memoryview]) -> Iterator[list[memoryview]]:
    """The buffers in calls of at most WRITE_BYTES and IOV_MAX buffers (larger buffers split)."""
    batch: list[memoryview] = []
    size = 0
    for buffer in buffers:
        while len(buffer):
            if size == WRITE_BYTES or len(batch) == IOV_MAX:
                yield batch
                batch, size = [], 0
            piece = buffer[: WRITE_BYTES - size]
            batch.append(piece)
            size += len(piece)
            buffer = buffer[len(piece) :]
    if batch:
        yield batch


def _copy_file(path: str, offset: int, fd: int, at: int, length: int) -> None:
    source = os.open(path, os.O_RDONLY)
    try:
        with _writing(fd):
            copy_range(source, offset, fd, at, length, name=path)
    finally:
        os.close(source)


def _allocate(fd: int, offset: int, length: int) -> None:
    """Allocate the file's blocks for the range before it is written (fallocate(2)): writes then fill
    allocated blocks instead of reserving them page by page (less kernel time per page written, measured
    in docs/scale.md). Only a hint: where the file system has no fallocate nothing happens (unlike
    posix_fallocate, which would write zeros over the range first)."""
    fallocate = getattr(_libc(), "fallocate", None)
    if fallocate is not None and length > 0:
        fallocate(fd, 0, ctypes.c_int64(offset), ctypes.c_int64(length))  # an error return is ignored


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def regular_fd(file) -> int | None:
    """The descriptor of `file` when it is a regular file that can be written at any offset."""
    try:
        fd = file.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) and file.seekable() else None
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    """What is left of `buffers` once a vectored read or write has moved `count` bytes."""
    while buffers and count >= len(buffers[0]):
        count -= len(buffers[0])
        buffers = buffers[1:]
    if buffers and count:
        buffers = [buffers[0][count:], *buffers[1:]]
    return buffers
