"""Byte-range copies between open files, in the kernel where it can, and writes from memory in small calls
(standard library only, so that exporters.hf.data_file can start copying before numpy or onnx are
imported)."""

from __future__ import annotations

import errno
import os

FALLBACK_CHUNK = 8 << 20
# Bytes a write call copies from user memory at most. A write of 1 MB gets a 1 MB folio (a large page of
# the page cache) on ext4 here, and the copy into it was 10-15x slower per byte than into the small folios
# of writes up to 512 KB, in most hours (docs/scale.md, seventh pass; the kernel's own copies, as `cp`
# makes them, write 64 KB at a time). 128 KB: 8192 calls a GB, fast at every size measured.
WRITE_BYTES = 128 << 10
_NO_KERNEL_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def copy_range(source: int, offset: int, fd: int, at: int, length: int, name: str = "") -> None:
    """Copy `length` bytes at `offset` of `source` to `at` of `fd`: in the kernel (copy_file_range), else
    (another file system, an old kernel) through a small buffer. A source that ends early is an OSError
    naming it (`name`: its path)."""
    done, source_name = 0, name or f"fd {source}"
    if hasattr(os, "copy_file_range"):
        try:
            while done < length:
                count = os.copy_file_range(source, fd, length - done, offset + done, at + done)
                if count == 0:
                    raise _ends_early(source_name, offset + done)
                done += count
        except OSError as error:
            if error.errno not in _NO_KERNEL_COPY:
                raise
    while done < length:
        block = os.pread(source, min(FALLBACK_CHUNK, length - done), offset + done)
        if not block:
            raise _ends_early(source_name, offset + done)
        write_at(fd, block, at + done)
        done += len(block)


def write_at(fd: int, data, at: int) -> None:
    """Write all of `data` (a bytes-like object) at offset `at` of `fd`, at most WRITE_BYTES a call."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view[:WRITE_BYTES], at)
        view, at = view[written:], at + written


def _ends_early(name: str, offset: int) -> OSError:
    return OSError(f"{name}: external data ends early (at byte {offset}; a truncated file?)")
