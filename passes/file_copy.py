"""Byte-range copies between open files, in the kernel where it can (standard library only, so that
exporters.hf_checkpoint can start copying before numpy or onnx are imported)."""

from __future__ import annotations

import errno
import os

FALLBACK_CHUNK = 8 << 20
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
        view = memoryview(block)
        while view:
            written = os.pwrite(fd, view, at + done)
            view, done = view[written:], done + written


def _ends_early(name: str, offset: int) -> OSError:
    return OSError(f"{name}: external data ends early (at byte {offset}; a truncated file?)")
