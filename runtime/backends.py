"""Session wrappers the generator runs: ONNX Runtime, TensorRT engines, and tensor-parallel rank graphs.

Every backend has the same small interface (`Backend`): `inputs` (name, shape, numpy dtype), `outputs`
(names), and `run(feeds) -> {output name: numpy array}`. Generation (runtime/generate.py) only talks to
that interface, so an ONNX Runtime session, a TensorRT engine and a set of TP rank graphs are
interchangeable.

- `OrtBackend`: ONNX Runtime; CPU, or CUDA when onnxruntime-gpu is installed (`device="cuda"/"auto"`).
- `TrtBackend`: one TensorRT engine on GPU 0 (datacenter TensorRT through exporters.tensorrt.shim). Thin:
  inputs and outputs are copied host <-> device on every call (the KV cache travels too).
- `TpThreadsBackend`: all ranks of a sharded folder (passes.shard) in this process, one thread each,
  the DistCollective all-reduces done between the threads (runtime.tp.ort.RankProgram runs the segments).
  The per-rank KV caches are shown to the caller as one cache, the ranks' heads concatenated on axis 1.
- `TpRankBackend`: this process's rank of a torch.distributed (gloo) launch; collectives through
  runtime.tp.ort.torch_collective. Every rank runs the same generation loop on its own cache shard.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx

from exporters.tensorrt import shim as trt_shim
from passes.errors import UserError
from passes.io.sessions import open_session, providers_for
from passes.shard import rank_onnx_files
from runtime.tp.ort import RankProgram, torch_collective

ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(int64)": np.int64,
    "tensor(float16)": np.float16,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}
ONNX_DTYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.BOOL: np.bool_,
}
Dim = int | str | None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[Dim, ...]
    dtype: type


class Backend(Protocol):
    name: str
    inputs: list[TensorInfo]
    outputs: list[str]
    vocab: int | None  # the logits' last dim when static

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


# ------------------------------------------------------------------------------------- ONNX Runtime


class OrtBackend:
    """An ONNX Runtime session over one ONNX file (external data is read beside it)."""

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"model {self.path} does not exist")
        self.session = open_session(self.path, threads=threads, providers=providers_for(device))
        self.name = f"onnxruntime:{self.session.get_providers()[0]}"
        self.inputs = [
            TensorInfo(i.name, tuple(i.shape), ORT_DTYPES.get(i.type, np.float32))
            for i in self.session.get_inputs()
        ]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.vocab = _last_dim(self.session.get_outputs()[0].shape)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds), strict=True))


# ----------------------------------------------------------------------------------------- TensorRT


class TrtBackend:
    """A TensorRT engine on the current CUDA device (needs datacenter TensorRT, torch CUDA and a GPU).

    Build the engine from a decode graph with a profile for every dynamic input; past_len must be allowed
    to be 0 (prefill). Not runnable on the CPU-only development machines.
    """

    def __init__(self, engine_path: str | Path) -> None:
        opened = trt_shim.open_engine(engine_path)
        self.trt, self.runtime = opened.trt, opened.runtime  # the runtime must outlive the engine
        self.engine, self.context = opened.engine, opened.context
        self.name = f"tensorrt:{self.trt.version}"
        self.inputs = [
            TensorInfo(n, tuple(_dim(d) for d in self.engine.get_tensor_shape(n)), self._dtype(n))
            for n in opened.inputs
        ]
        self.outputs = opened.outputs
        self.vocab = _last_dim(self.engine.get_tensor_shape(self.outputs[0]))

    def _dtype(self, name: str) -> type:
        return np.dtype(self.trt.module.nptype(self.engine.get_tensor_dtype(name))).type

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch  # noqa: PLC0415 (torch: seconds to import; only the TensorRT backend (CUDA buffers) needs it)

        stream = torch.cuda.current_stream()
        keep = []
        for info in self.inputs:
            tensor = torch.from_numpy(np.ascontiguousarray(feeds[info.name], dtype=info.dtype)).cuda()
            # an empty past (prefill) has no storage: give TensorRT a real address all the same
            storage = tensor if tensor.numel() else torch.empty(1, dtype=tensor.dtype, device="cuda")
            keep.append(storage)
            self.context.set_input_shape(info.name, tuple(tensor.shape))
            self.context.set_tensor_address(info.name, storage.data_ptr())
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = torch.from_numpy(np.zeros(0, dtype=self._dtype(name))).dtype
            outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise UserError("TensorRT execute_async_v3 failed")
        stream.synchronize()
        return {name: t.cpu().numpy() for name, t in outputs.items()}


def _last_dim(shape: Sequence) -> int | None:
    last = shape[-1] if len(shape) else None
    return int(last) if isinstance(last, int) and last > 0 else None


def _dim(d: int) -> Dim:
    return None if d < 0 else int(d)


# ------------------------------------------------------------------------------- tensor parallelism


def _graph_inputs(path: Path) -> list[TensorInfo]:
    proto = onnx.load(str(path), load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    infos = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
        )
        infos.append(TensorInfo(value.name, shape, ONNX_DTYPES.get(tensor.elem_type, np.float32)))
    return infos


def _output_vocab(path: Path) -> int | None:
    proto = onnx.load(str(path), load_external_data=False)
    dims = proto.graph.output[0].type.tensor_type.shape.dim
    return int(dims[-1].dim_value) if dims and dims[-1].HasField("dim_value") else None


def _is_cache(name: str) -> bool:
    return name.startswith(("past_key_", "past_value_", "present_key_", "present_value_"))


class _ThreadCollective:
    """Sum (all_reduce) or concatenate (all_gather) arrays across `world` threads, in call order."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.parts: list[np.ndarray | None] = [None] * world
        self.result: np.ndarray | None = None
        self.calls = 0

    def for_rank(self, rank: int):
        def run(collective: Any, array: np.ndarray) -> np.ndarray:
            self.parts[rank] = array
            if self.barrier.wait() == 0:
                if collective.operation == "all_reduce":
                    self.result = np.sum(np.stack(self.parts), axis=0, dtype=array.dtype)
                elif collective.operation == "all_gather":
                    self.result = np.concatenate(self.parts, axis=0)
                else:
                    raise UserError(f"DistCollective {collective.operation!r} is not supported")
                self.calls += 1
            self.barrier.wait()
            result = self.result
            self.barrier.wait()  # nobody overwrites `result` before everyone has read it
            return result

        return run


class TpThreadsBackend:
    """Every rank graph of a sharded folder in this process, one thread per rank (CPU reference).

    Inputs and outputs look like the unsharded graph's: cache tensors are the ranks' KV heads
    concatenated along axis 1 (each rank's own share is split back off before it runs).
    """

    def __init__(self, directory: str | Path, threads_per_rank: int = 1) -> None:
        self.directory = Path(directory)
        files = rank_onnx_files(self.directory)
        self.programs = [RankProgram(f, threads_per_rank) for f in files]
        self.world = len(files)
        self.name = f"tp{self.world}-threads"
        per_rank = [_graph_inputs(f) for f in files]
        self.kv_split = {
            info.name: [r[k].shape[1] for r in per_rank]
            for k, info in enumerate(per_rank[0])
            if _is_cache(info.name)
        }
        for name, sizes in self.kv_split.items():
            if not all(isinstance(s, int) for s in sizes):
                raise UserError(f"{self.directory}: rank graphs do not record the KV heads of {name}")
        self.inputs = [
            TensorInfo(i.name, (i.shape[0], sum(self.kv_split[i.name]), *i.shape[2:]), i.dtype)
            if i.name in self.kv_split
            else i
            for i in per_rank[0]
        ]
        self.outputs = list(self.programs[0].outputs)
        self.vocab = _output_vocab(files[0])
        self.allreduces = 0

    def _rank_feeds(self, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        out: list[dict[str, np.ndarray]] = [{} for _ in range(self.world)]
        for name, array in feeds.items():
            if name in self.kv_split:
                bounds = np.cumsum(self.kv_split[name])[:-1]
                for rank, part in enumerate(np.split(array, bounds, axis=1)):
                    out[rank][name] = np.ascontiguousarray(part)
            else:
                for rank in range(self.world):
                    out[rank][name] = array
        return out

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        collective = _ThreadCollective(self.world)
        results: list[dict[str, np.ndarray] | None] = [None] * self.world
        errors: list[BaseException] = []

        def work(rank: int, rank_feeds: dict[str, np.ndarray]) -> None:
            try:
                results[rank] = self.programs[rank].run(rank_feeds, collective.for_rank(rank))
            except BaseException as exc:  # noqa: BLE001 - reraised in the caller's thread
                errors.append(exc)
                collective.barrier.abort()

        threads = [threading.Thread(target=work, args=(r, f)) for r, f in enumerate(self._rank_feeds(feeds))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.allreduces = collective.calls
        merged = dict(results[0])
        for name in merged:
            if _is_cache(name):
                merged[name] = np.concatenate([r[name] for r in results], axis=1)
        return merged


class TpRankBackend:
    """This process's rank graph under torch.distributed (gloo); every rank runs the same loop."""

    def __init__(
        self, directory: str | Path, rank: int, world: int, threads: int = 1, device: str = "cpu"
    ) -> None:
        files = rank_onnx_files(directory)
        if len(files) != world:
            raise UserError(f"{directory} holds {len(files)} ranks; the launch has {world}")
        # device "cuda": ONNX Runtime's CUDA provider and NCCL collectives on this process's visible GPU
        self.program = RankProgram(files[rank], threads, providers_for(device))
        self.collective = torch_collective(world, "cuda" if device == "cuda" else None)
        self.name = f"tp{world}-{'nccl' if device == 'cuda' else 'gloo'}"
        self.inputs = _graph_inputs(files[rank])
        self.outputs = list(self.program.outputs)
        self.vocab = _output_vocab(files[rank])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.program.run(feeds, self.collective)


def open_backend(
    target: str | Path,
    device: str = "cpu",
    threads: int | None = None,
    tp_mode: str = "threads",
    rank: int = 0,
    world: int = 1,
) -> Backend:
    """An ONNX file -> OrtBackend; a *.engine/*.plan file -> TrtBackend; a sharded folder -> TP backend."""
    path = Path(target)
    if path.is_dir():
        if tp_mode == "threads":
            return TpThreadsBackend(path, threads or 1)
        if tp_mode == "gloo":
            return TpRankBackend(path, rank, world, threads or 1)
        raise UserError(f"unknown TP mode {tp_mode!r}; use threads or gloo")
    if path.suffix in (".engine", ".plan"):
        return TrtBackend(path)
    return OrtBackend(path, device, threads)
