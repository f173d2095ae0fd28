"""Joining a torch.distributed process group on this host: the CPU rank processes (gloo) of the
tensor-parallel benchmark and of the server's TP ranks, or NCCL on GPUs; and the group of a torchrun
launch (tools/run_tp.py, tools/generate.py)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from passes.errors import UserError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Make this rank process end (SIGTERM) when the process that spawned it dies, on Linux: a spawned rank
    whose parent was killed otherwise waits in a gloo collective forever, spinning (found: 8 orphans of a
    killed `analyze.py --bench-tp 8`, each at 15% of a core). Call it first thing in a rank spawned from the
    main thread (the signal follows the spawning thread)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def init_gloo(
    rank: int, world: int, port: int, backend: str = "gloo", timeout_s: float | None = None
) -> None:
    """Join a process group on 127.0.0.1:port (gloo; "nccl" on GPUs); `timeout_s` bounds every collective."""
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the processes that join a group)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **timeout)


@contextmanager
def torchrun_group(hint: str = "launch it with torchrun --nproc-per-node N") -> Iterator[tuple[int, int]]:
    """The gloo group of this torchrun launch, joined (unless already) and left on exit: (rank, world).
    Outside torchrun (RANK unset) a UserError ending in `hint`."""
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the processes that join a group)

    joined = not dist.is_initialized()
    if joined:
        if "RANK" not in os.environ:
            raise UserError(f"not running under torchrun (RANK/WORLD_SIZE are not set): {hint}")
        dist.init_process_group("gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        if joined:
            dist.destroy_process_group()
