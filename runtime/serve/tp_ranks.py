"""Serving a tensor-parallel folder with one process per rank (gloo on CPUs, NCCL on GPUs).

`TpRanks` is a `runtime.serve.batch.Runner`, so the scheduler drives it like any other backend. It spawns
one process per rank graph of a sharded folder (passes.shard). Every rank process joins one
torch.distributed group on 127.0.0.1 (runtime.tp.gloo.init_gloo), opens its rank graph
(runtime.backends.TpRankBackend: ONNX Runtime segments, DistCollective all-reduces through
torch.distributed) and keeps ITS OWN share of the KV caches in the runner batch.py gives its graph.

The server sends every call (prefill, decode, release) to all ranks over one pipe each; the ranks run the
same runner code on the same inputs in lockstep, all-reducing inside the step, so their caches stay
aligned; rank 0 sends back the logits (a prompt's chunk's positions' logits when the scheduler scores it:
at most one chunk's worth per call), the others only "ok". No cache crosses a process boundary.

Failures: a rank that exits, dies, stops beating, or does not answer within `timeout_s` breaks the group:
every rank process is stopped, the call raises `RanksDown` and `problem` says why; the scheduler treats a
problem as fatal (every request fails; the server exits or answers 503, runtime/serve/app.py). A Python
error that every rank raises alike (a bad call) fails only that call.

A decode step that fails on every rank alike (a row whose input breaks the graph: each rank raises at the
same point, so no rank is left waiting in an all-reduce) is retried row by row as a second call
(`decode_alone`, runtime.serve.batch): the ranks run the same rows in the same order, so their collectives
pair up, and the rows that fail alone leave every rank's runner (RowsFailed). The batched step runs without
isolation on the ranks (`isolate=False`): a rank must not retry alone while another still waits in the
step's all-reduce (its fault was its own, e.g. out of memory): such a fault is not unanimous, the waiting
rank does not answer within ERROR_GRACE_S, and the group breaks as for a hung rank. Ranks that disagree on
which rows failed alone no longer hold the same rows: the group breaks too. `close()` stops the processes (the
app calls it on shutdown); a rank whose server went away exits when its pipe closes.

Heartbeat: a thread in every rank process writes the time into a shared array every HEARTBEAT_S, whatever
the rank's main thread is doing (ONNX Runtime and the collectives release the GIL); a monitor thread here
breaks the group when a rank's beat is older than `heartbeat_timeout_s`, naming that rank. So a rank that
hangs (SIGSTOP, a stuck driver) is found in seconds, not at `timeout_s`, and not blamed on the rank that
waits for it in an all-reduce.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from passes.errors import UserError
from passes.shard import rank_onnx_files
from runtime.backends import TpRankBackend
from runtime.generate import DecodeModel
from runtime.ports import free_port
from runtime.serve.batch import Chunk, Prefilled, RowsFailed, runner_for
from runtime.tp.gloo import init_gloo

HEARTBEAT_S = 0.25
HEARTBEAT_TIMEOUT_S = 5.0
ERROR_GRACE_S = 5.0  # after one rank reports an error, how long the others may take to answer
STOP_WAIT_S = 10.0
COMMS = ("gloo", "nccl")
PRELOAD = ["torch.distributed", "runtime.backends", "runtime.bench.decode", "runtime.serve.tp_ranks"]


class RanksDown(RuntimeError):
    """The rank processes are gone (one exited or hung); the folder is no longer being served."""


class RankErrors(RuntimeError):
    """A call failed on some ranks (`unanimous`: on all of them) with a Python error; the group lives on."""

    def __init__(self, message: str, unanimous: bool) -> None:
        super().__init__(message)
        self.unanimous = unanimous


@dataclass(frozen=True)
class RankSettings:
    directory: str
    world: int
    port: int
    left_padding: bool = True  # False: GenAI graphs (runtime.serve.batch.GroupedRunner)
    threads: int = 1  # ONNX Runtime intra-op threads per rank
    comm: str = "gloo"  # "nccl": one GPU per rank, ONNX Runtime's CUDA provider
    timeout_s: float = 120.0  # a collective (or a call) slower than this breaks the group


# ------------------------------------------------------------------------------------ a rank process


def _beat(beats: Any, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        time.sleep(HEARTBEAT_S)


def _rank_main(rank: int, settings: RankSettings, conn: Connection, beats: Any) -> None:
    threading.Thread(target=_beat, args=(beats, rank), name="tp-heartbeat", daemon=True).start()
    if settings.comm == "nccl":  # before CUDA initializes: GPU `rank` is this process's device 0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the rank processes, after CUDA_VISIBLE_DEVICES is set)

    try:
        init_gloo(rank, settings.world, settings.port, settings.comm, settings.timeout_s)
        device = "cuda" if settings.comm == "nccl" else "cpu"
        backend = TpRankBackend(settings.directory, rank, settings.world, settings.threads, device)
        model = DecodeModel(backend)
        runner = runner_for(model, settings.left_padding)
        ready = {
            "vocab": backend.vocab,
            "cached": model.cached,
            "name": backend.name,
            "chunked": runner.chunked,
        }
        conn.send(("ready", ready))
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which refuses to start
        conn.send(("error", _describe(exc)))
        return
    try:
        _serve_calls(runner, rank, conn)
    finally:
        dist.destroy_process_group()


def _serve_calls(runner: Any, rank: int, conn: Connection) -> None:
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if op == "close":
            return
        try:
            result = getattr(runner, op)(*args)
        except RowsFailed as rows:  # those rows left this rank's runner; the server checks every rank agrees
            conn.send(("rows", (rows.done if rank == 0 else None, rows.failed)))
            continue
        except Exception as exc:  # noqa: BLE001 - this call fails, the rank keeps serving
            conn.send(("error", _describe(exc)))
            continue
        conn.send(("ok", result if rank == 0 else None))


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------- the server's side


class TpRanks:
    """The rank processes of a sharded folder, driven as one Runner (module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        left_padding: bool = True,
        threads: int = 1,
        comm: str = "gloo",
        timeout_s: float = 120.0,
        start_timeout_s: float = 600.0,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        if comm not in COMMS:
            raise UserError(f"unknown collective backend {comm!r}; use {' or '.join(COMMS)}")
        world = len(rank_onnx_files(directory))
        if comm == "nccl":
            _check_gpus(world)
        port = free_port()
        self.settings = RankSettings(str(directory), world, port, left_padding, threads, comm, timeout_s)
        self.keys: set[Hashable] = set()
        self.failure: str | None = None
        self.in_call = False
        self._lock = threading.Lock()
        context = _context()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.beats = context.Array("d", [time.monotonic()] * world, lock=False)
        self.conns: list[Connection] = []
        self.processes: list[Any] = []
        for rank in range(world):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(rank, self.settings, theirs, self.beats),
                name=f"tp-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)
        try:
            replies = self._replies(start_timeout_s)
        except RanksDown as exc:
            self._stop_all()
            raise UserError(f"{directory}: the rank processes did not start: {exc}") from None
        errors = [f"rank {r}: {value}" for r, (kind, value) in enumerate(replies) if kind == "error"]
        if errors:
            self._stop_all()
            raise UserError(f"{directory}: {errors[0]}")
        info = replies[0][1]
        self.vocab: int | None = info["vocab"]
        self.cached: bool = info["cached"]
        self.chunked: bool = info["chunked"]
        self.name = f"{info['name']} ({world} processes)"
        threading.Thread(target=self._monitor, name="tp-monitor", daemon=True).start()

    @property
    def world(self) -> int:
        return self.settings.world

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def problem(self) -> str | None:
        """None while every rank process runs, else why the folder is not served any more."""
        if self.failure is None:
            dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
            if dead:
                return f"rank {dead[0]} exited ({_exit(self.processes[dead[0]])})"
        return self.failure

    # ------------------------------------------------------------------------------------ Runner

    def __len__(self) -> int:
        return len(self.keys)

    def prefill_many(self, prompts: dict[Hashable, Sequence[int]]) -> dict[Hashable, Prefilled]:
        return self.prefill({key: Chunk(prompt) for key, prompt in prompts.items()})

    def prefill(self, chunks: dict[Hashable, Chunk]) -> dict[Hashable, Prefilled]:
        plain = {k: Chunk([int(t) for t in c.tokens], c.last, c.positions) for k, c in chunks.items()}
        prefilled = self._call("prefill", plain)
        self.keys.update(chunks)
        return prefilled

    def decode(self, tokens: dict[Hashable, int], isolate: bool = True) -> dict[Hashable, np.ndarray]:
        """The batched step; when every rank fails it alike, row by row (module docstring)."""
        tokens = {k: int(t) for k, t in tokens.items()}
        try:
            return self._call("decode", tokens, False)
        except RankErrors as exc:
            if not (isolate and exc.unanimous and len(tokens) > 1):
                raise
        return self.decode_alone(tokens)

    def decode_alone(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        return self._call("decode_alone", {k: int(t) for k, t in tokens.items()})

    def release(self, key: Hashable) -> None:
        """Never raises (the scheduler releases while it finishes requests): a broken group is recorded in
        `problem`, and the next prefill or decode reports it."""
        if key in self.keys and self.failure is None:
            with contextlib.suppress(RanksDown, RuntimeError):
                self._call("release", key)
        self.keys.discard(key)

    def close(self) -> None:
        """Stop every rank process (idempotent). A call that is stuck (its rank hung) does not hold the
        shutdown up beyond STOP_WAIT_S: the processes are killed under it."""
        locked = self._lock.acquire(timeout=STOP_WAIT_S)
        try:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(("close", ()))
            deadline = time.monotonic() + STOP_WAIT_S
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            self._stop_all()
            if self.failure is None:
                self.failure = "the rank processes were stopped"
        finally:
            if locked:
                self._lock.release()

    # ---------------------------------------------------------------------------------- plumbing

    def _monitor(self) -> None:
        """Break the group when a rank's heartbeat is older than heartbeat_timeout_s (module docstring).
        The processes are killed here; a call waiting on them then fails at once, with this reason."""
        while self.failure is None:
            time.sleep(HEARTBEAT_S)
            now = time.monotonic()
            late = [(now - self.beats[r], r) for r in range(self.world) if self.processes[r].is_alive()]
            late = [(age, r) for age, r in late if age > self.heartbeat_timeout_s]
            if late and self.failure is None:
                age, rank = max(late)
                self.failure = f"rank {rank} stopped answering (no heartbeat for {age:.1f} s)"
                for process in self.processes:
                    if process.is_alive():
                        process.kill()

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self.problem is not None:
                raise RanksDown(self.problem)
            self.in_call = True
            try:
                for conn in self.conns:
                    conn.send((op, args))
                replies = self._replies(self.settings.timeout_s)
            except (OSError, RanksDown) as exc:
                self._break(str(exc) if isinstance(exc, RanksDown) else f"a rank's pipe broke: {exc}")
                raise RanksDown(self.failure) from None
            finally:
                self.in_call = False
        kinds = {kind for kind, _ in replies}
        if "rows" in kinds:
            failed = [set(value[1]) if kind == "rows" else set() for kind, value in replies]
            if kinds != {"rows"} or any(f != failed[0] for f in failed):
                self._break(f"the ranks failed different rows of one {op} (rows per rank: {failed})")
                raise RanksDown(self.failure)
            done, reasons = replies[0][1]
            self.keys.difference_update(reasons)
            raise RowsFailed(done, reasons)
        errors = [f"rank {r}: {value}" for r, (kind, value) in enumerate(replies) if kind == "error"]
        if errors:
            raise RankErrors(errors[0], unanimous=len(errors) == self.world)
        return replies[0][1]

    def _replies(self, timeout_s: float) -> list[tuple[str, Any]]:
        """One reply per rank; RanksDown if a rank exits before it answers, or does not answer in time."""
        replies: list[tuple[str, Any] | None] = [None] * self.world
        pending = dict(enumerate(self.conns))
        start = time.monotonic()
        deadline = start + timeout_s

        def down(reason: str) -> RanksDown:
            if self.failure is not None:  # the heartbeat monitor found the rank to blame
                return RanksDown(self.failure)
            first = next((f"rank {r}: {v[1]}" for r, v in enumerate(replies) if v and v[0] == "error"), None)
            return RanksDown(f"{first} ({reason})" if first else reason)

        while pending:
            sentinels = {self.processes[r].sentinel: r for r in pending}
            ready = wait([*pending.values(), *sentinels], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise down(f"rank {min(pending)} did not answer in {time.monotonic() - start:.0f} s")
            for rank in [r for r, conn in pending.items() if conn in ready]:
                try:
                    replies[rank] = pending.pop(rank).recv()
                except (EOFError, OSError):
                    raise down(f"rank {rank} exited ({_exit(self.processes[rank])})") from None
                if replies[rank][0] == "error":  # the others should fail alike, at once
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            exited = [r for s, r in sentinels.items() if s in ready and r in pending]
            if exited:
                raise down(f"rank {exited[0]} exited ({_exit(self.processes[exited[0]])})")
        return replies  # type: ignore[return-value]

    def _break(self, reason: str) -> None:
        self.failure = reason
        self._stop_all()

    def _stop_all(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()  # a rank blocked in a collective (or stopped) only goes this way
        for process in self.processes:
            process.join(STOP_WAIT_S)
        for conn in self.conns:
            conn.close()


def _check_gpus(world: int) -> None:
    import torch  # noqa: PLC0415 (torch: seconds to import; only --tp-comm nccl's GPU check needs it here)
    import torch.distributed as dist  # noqa: PLC0415 (torch: seconds to import; only --tp-comm nccl's GPU check needs it here)

    gpus = torch.cuda.device_count()
    if not dist.is_nccl_available() or gpus < world:
        raise UserError(
            f"--tp-comm nccl needs torch with NCCL and {world} GPUs (one per rank); this machine has {gpus}"
            + ("" if dist.is_nccl_available() else " and torch without NCCL")
            + ": use --tp-comm gloo"
        )


def _context() -> Any:
    """Rank processes fork from a fresh single-threaded server process that has imported torch and the
    runtime once (forkserver): no fork of a process with threads (uvicorn, ONNX Runtime), and no import of
    torch per rank, per start."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _exit(process: Any) -> str:
    process.join(1.0)  # a forkserver child's exit code is known once it is reaped
    code = process.exitcode
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
