"""Tensor-parallel TensorRT: one engine per rank graph, each execution context with an NCCL communicator.

Deployment path (datacenter TensorRT >= 10.16 on Hopper, one GPU per rank, `nccl4py`, launched by
torchrun). It cannot run on the CPU-only development machines; what can run there is
`build_rank_engines` with TensorRT-RTX (ahead of time for sm89), which proves that every rank graph,
DistCollective nodes included, parses and builds.

Per rank (all ranks concurrently, one process each):

1. torch.distributed (gloo) is only used to hand NCCL's unique id from rank 0 to the others.
2. `nccl.core.Communicator.init(nranks, rank, unique_id)` (nccl4py) makes the communicator; its raw
   `ncclComm_t` goes to `IExecutionContext.set_communicator` as a PyCapsule named "ncclComm_t". That
   call is collective: it returns only when every rank has made it.
3. the engine runs with `execute_async_v3`; its DistCollective layers all-reduce over NVLink/NCCL.
   Every rank enqueues the same forward at the same time (a rank that does not enqueue deadlocks the
   others inside the first all-reduce).

    torchrun --nproc-per-node 8 tools/run_tp.py tp8/ --tokens ids.npy --out logits.npy --backend trt
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exporters.tensorrt import shim as trt_shim
from exporters.tensorrt.build import Profile, build_engine, parse_onnx
from passes.errors import UserError
from passes.shard import rank_onnx_files, read_manifest
from runtime.tp.ort import torchrun_rank

DEFAULT_ENGINE_NAME = "model.engine"


def engine_paths(directory: str | Path, pattern: str | None = None) -> list[Path]:
    """Engine file per rank: `pattern` with {rank}, or DIR/rank{r}/model.engine beside each rank graph."""
    files = rank_onnx_files(directory)
    if pattern is None:
        return [f.with_name(DEFAULT_ENGINE_NAME) for f in files]
    if "{rank}" not in pattern:
        raise UserError(f"--engines {pattern!r} must contain {{rank}}")
    return [Path(pattern.format(rank=r)) for r in range(len(files))]


# ------------------------------------------------------------------------------------- ahead of time


@dataclass
class RankBuild:
    rank: int
    onnx: Path
    engine: Path
    plan_bytes: int
    collective_layers: int
    seconds: float


def count_collective_layers(onnx_path: str | Path) -> int:
    """How many DistCollective layers TensorRT's ONNX parser makes of a rank graph."""
    trt = trt_shim.load()
    logger = trt.logger()
    builder = trt.module.Builder(logger.handle)
    network, _parser = parse_onnx(trt, builder, Path(onnx_path), logger)
    kind = trt.dist_collective_layer_type()
    return sum(network.get_layer(i).type == kind for i in range(network.num_layers))


def build_rank_engines(
    directory: str | Path,
    *,
    batch: tuple[int, int, int] = (1, 1, 4),
    seq: tuple[int, int, int] = (1, 64, 512),
    compute_capability: str | None = None,
    engine_pattern: str | None = None,
) -> list[RankBuild]:
    """Build one engine per rank graph (TensorRT-RTX here: ahead of time for sm89)."""
    profile = Profile.batch_seq(batch, seq)
    builds = []
    for rank, (onnx_path, engine) in enumerate(
        zip(rank_onnx_files(directory), engine_paths(directory, engine_pattern), strict=True)
    ):
        result = build_engine(onnx_path, engine, profile=profile, compute_capability=compute_capability)
        builds.append(
            RankBuild(
                rank,
                onnx_path,
                engine,
                result.plan_bytes,
                count_collective_layers(onnx_path),
                result.build_seconds,
            )
        )
    return builds


# ------------------------------------------------------------------------------------------ run time


def communicator_capsule(comm: Any) -> Any:
    """The PyCapsule("ncclComm_t") that IExecutionContext.set_communicator takes, from nccl4py's comm."""
    pointer = int(getattr(comm, "ptr", 0) or 0)
    if pointer == 0:
        raise UserError("the NCCL communicator is not initialized (ptr == 0)")
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new_capsule(ctypes.c_void_p(pointer), b"ncclComm_t", None)


def nccl_communicator(rank: int, world: int) -> Any:
    """nccl4py communicator over all ranks; the unique id travels from rank 0 via torch.distributed."""
    import torch.distributed as dist  # noqa: PLC0415 (torch and nccl4py: GPU ranks only, loaded when they run)

    try:
        import nccl.core as nccl  # noqa: PLC0415 (nccl4py: optional, GPU ranks only)
    except ImportError as exc:
        raise UserError("the TensorRT backend needs nccl4py (`pip install nccl4py`)") from exc
    payload = [nccl.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    return nccl.Communicator.init(nranks=world, rank=rank, unique_id=payload[0])


class TrtRank:
    """One rank's engine and execution context on this process's GPU."""

    def __init__(self, engine_path: str | Path) -> None:
        opened = trt_shim.open_engine(engine_path, hint="; build it with tools/build_engines.py")
        self.trt, self.runtime = opened.trt, opened.runtime  # the runtime must outlive the engine
        self.engine, self.context = opened.engine, opened.context
        self.inputs, self.outputs = opened.inputs, opened.outputs
        self.comm: Any = None

    def attach(self, comm: Any) -> None:
        """Hand the NCCL communicator to the context (collective: every rank calls it together)."""
        self.comm = comm  # keep it alive as long as the context uses it
        if not self.context.set_communicator(communicator_capsule(comm)):
            raise UserError("IExecutionContext.set_communicator failed")

    def run(self, tokens: np.ndarray) -> dict[str, Any]:
        """Enqueue one forward on this rank's stream and wait for it; torch CUDA tensors out."""
        import torch  # noqa: PLC0415 (torch: seconds to import; only GPU ranks need it)

        if len(self.inputs) != 1:
            raise UserError(f"expected one engine input (input_ids), found {self.inputs}")
        stream = torch.cuda.current_stream()
        ids = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).cuda()
        self.context.set_input_shape(self.inputs[0], tuple(ids.shape))
        self.context.set_tensor_address(self.inputs[0], ids.data_ptr())
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = _torch_dtype(self.trt.module.nptype(self.engine.get_tensor_dtype(name)))
            outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise UserError("execute_async_v3 failed")
        stream.synchronize()
        return outputs


def _torch_dtype(np_dtype: Any) -> Any:
    import torch  # noqa: PLC0415 (torch: seconds to import; only GPU ranks need it)

    return torch.from_numpy(np.zeros(1, dtype=np_dtype)).dtype


def run_distributed_trt(
    directory: str | Path, tokens: np.ndarray, engine_pattern: str | None = None, warmup: int = 0
) -> np.ndarray | None:
    """This process's rank of a torchrun launch on GPUs; returns float32 logits on rank 0."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only GPU ranks need it)
    import torch.distributed as dist  # noqa: PLC0415 (torch: only GPU ranks need it)

    manifest = read_manifest(directory)
    engines = engine_paths(directory, engine_pattern)
    rank, world = torchrun_rank(directory, manifest["tp"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    engine = TrtRank(engines[rank])
    engine.attach(nccl_communicator(rank, world))
    for _ in range(warmup):
        engine.run(tokens)
    dist.barrier()
    outputs = engine.run(tokens)
    dist.barrier()
    if rank != 0:
        return None
    return outputs[engine.outputs[0]].float().cpu().numpy()
