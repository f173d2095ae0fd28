"""Joining a torch.distributed process group on this host: the CPU rank processes (gloo) of the
tensor-parallel benchmark and of the server's TP ranks, or NCCL on GPUs."""

from __future__ import annotations

import os
import socket
from datetime import timedelta


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(
    rank: int, world: int, port: int, backend: str = "gloo", timeout_s: float | None = None
) -> None:
    """Join a process group on 127.0.0.1:port (gloo; "nccl" on GPUs); `timeout_s` bounds every collective."""
    import torch.distributed as dist  # torch only in the processes that join a group

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **timeout)
