"""CPU reference runtime for tensor-parallel rank graphs (written by passes.shard).

ONNX Runtime cannot run `DistCollective`, so each rank graph is cut at its DistCollective nodes into
consecutive segments; each segment is an ONNX model of its own (weights stay in the rank's external data
file), run by ONNX Runtime. Between segments the collective runs outside ORT: through torch.distributed
(gloo) when every rank is its own process (`tools/run_tp.py` under torchrun), or summed in one process
(`run_simulated`, for tests and for checking rank graphs written by other tools).

    torchrun --nproc-per-node 2 tools/run_tp.py DIR --tokens ids.npy --out logits.npy
"""

from __future__ import annotations

import heapq
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from passes.error_measures import max_abs_relative_error
from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.io.sessions import CPU, open_session
from passes.shard import COLLECTIVE_OP, rank_onnx_files, read_manifest
from runtime.ports import free_port
from runtime.tp.gloo import die_with_parent, init_gloo

__all__ = [
    "Collective",
    "RankProgram",
    "Segment",
    "rank_onnx_files",
    "reference_error",
    "run_distributed",
    "run_simulated",
    "split_rank_graph",
]



@dataclass(frozen=True)
class Collective:
    """One DistCollective node: what it reduces and where the result goes."""

    operation: str  # "all_reduce" or "all_gather"
    reduce_op: str
    input: str
    output: str
    nb_rank: int


@dataclass
class Segment:
    """Consecutive nodes between two collectives, as a standalone ONNX model."""

    model: onnx.ModelProto | None  # None when the segment is empty
    inputs: list[str]
    outputs: list[str]
    collective: Collective | None  # the collective that follows the segment
    release: list[str] = field(default_factory=list)  # values no later segment needs


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def _value_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    graph = proto.graph
    return {
        v.name: v.type
        for v in [*graph.input, *graph.output, *graph.value_info]
        if v.type.tensor_type.elem_type
    }


def _infer_types(model: onnx.ModelProto, names: list[str], types: dict[str, onnx.TypeProto]) -> None:
    """Element types of a segment's outputs that the rank graph does not record (from shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    for v in [*inferred.graph.value_info, *inferred.graph.output]:
        if v.name in names and v.type.tensor_type.elem_type:
            types.setdefault(v.name, v.type)


def _untyped_shape(type_proto: onnx.TypeProto) -> onnx.TypeProto:
    """The element type only: segment boundaries take any shape (rank graphs' shapes may be stale)."""
    out = onnx.TypeProto()
    out.tensor_type.elem_type = type_proto.tensor_type.elem_type
    return out


def split_rank_graph(path: str | Path) -> tuple[list[Segment], list[str], list[str]]:
    """Cut a rank graph at its collectives: (segments, graph input names, graph output names)."""
    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    initializers = {t.name: t for t in graph.initializer}
    types = _value_types(proto)
    for t in graph.initializer:
        types.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, None))
    groups: list[tuple[list[onnx.NodeProto], Collective | None]] = []
    current: list[onnx.NodeProto] = []
    for node in _toposorted(graph):
        if node.op_type == COLLECTIVE_OP:
            collective = Collective(
                _attr(node, "collective_operation", ""),
                _attr(node, "reduce_op", "sum"),
                node.input[0],
                node.output[0],
                int(_attr(node, "nb_rank", 0)),
            )
            groups.append((current, collective))
            current = []
        else:
            current.append(node)
    groups.append((current, None))
    graph_outputs = [o.name for o in graph.output]
    graph_inputs = [i.name for i in graph.input if i.name not in initializers]
    later_needs = _later_needs(groups, graph_outputs)
    opsets = [o for o in proto.opset_import if o.domain in ("", "ai.onnx", "com.microsoft")]
    segments: list[Segment] = []
    available: set[str] = set(graph_inputs)
    for k, (nodes, collective) in enumerate(groups):
        produced = {o for n in nodes for o in n.output if o}
        consumed = [i for n in nodes for i in n.input if i]
        inputs = sorted({i for i in consumed if i not in produced and i not in initializers})
        missing = [i for i in inputs if i not in available]
        if missing:
            raise UserError(f"{path}: segment {k} reads {missing[0]!r}, which nothing before it computes")
        outputs = sorted(produced & later_needs[k])
        model = None
        if nodes and outputs:
            model = _segment_model(proto, k, nodes, inputs, outputs, consumed, initializers, types, opsets)
        available |= set(outputs)
        if collective is not None:
            available.add(collective.output)
            if collective.input in types:
                types.setdefault(collective.output, types[collective.input])
        segments.append(Segment(model, inputs, outputs, collective))
    _mark_releases(segments, graph_outputs)
    return segments, graph_inputs, graph_outputs


def _segment_model(
    proto, k, nodes, inputs, outputs, consumed, initializers, types, opsets
) -> onnx.ModelProto:
    untyped = [i for i in inputs if i not in types]
    if untyped:
        raise UserError(f"segment {k} input {untyped[0]!r} has no recorded element type")

    def build() -> onnx.ModelProto:
        graph = onnx.helper.make_graph(
            nodes,
            f"segment{k}",
            [onnx.helper.make_value_info(i, _untyped_shape(types[i])) for i in inputs],
            [
                onnx.helper.make_value_info(o, _untyped_shape(types[o]) if o in types else onnx.TypeProto())
                for o in outputs
            ],
            [initializers[i] for i in sorted({i for i in consumed if i in initializers})],
        )
        return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=proto.ir_version)

    model = build()
    if any(o not in types for o in outputs):
        _infer_types(model, outputs, types)
        missing = [o for o in outputs if o not in types]
        if missing:
            raise UserError(f"segment {k}: cannot tell the element type of {missing[0]!r}")
        model = build()
    return model


def _toposorted(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in dependency order, file order among ready nodes (other tools append collectives last)."""

    nodes = list(graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    waiting = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for k, node in enumerate(nodes):
        deps = {producer[i] for i in node.input if i in producer and producer[i] != k}
        waiting[k] = len(deps)
        for d in deps:
            users[d].append(k)
    ready = [k for k in range(len(nodes)) if waiting[k] == 0]
    heapq.heapify(ready)
    order: list[onnx.NodeProto] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for u in users[k]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise UserError(f"graph {graph.name!r} has a cycle")
    return order


def _later_needs(groups, graph_outputs: list[str]) -> list[set[str]]:
    """For each segment, the values that later segments, its collective or the graph outputs read."""
    needs: list[set[str]] = [set() for _ in groups]
    running = set(graph_outputs)
    for k in range(len(groups) - 1, -1, -1):
        nodes, collective = groups[k]
        if collective is not None:
            running.add(collective.input)
        needs[k] = set(running)
        running |= {i for n in nodes for i in n.input if i}
    return needs


def _mark_releases(segments: list[Segment], graph_outputs: list[str]) -> None:
    last_use: dict[str, int] = {}
    for k, seg in enumerate(segments):
        for name in seg.inputs:
            last_use[name] = k
        if seg.collective is not None:
            last_use[seg.collective.input] = k
    for name, k in last_use.items():
        if name not in graph_outputs:
            segments[k].release.append(name)


CollectiveFn = Callable[[Collective, np.ndarray], np.ndarray]


class RankProgram:
    """One rank graph as ONNX Runtime sessions, one per segment."""

    def __init__(self, path: str | Path, threads: int = 1, providers: Sequence[str] = CPU) -> None:
        self.path = Path(path)
        self.segments, self.inputs, self.outputs = split_rank_graph(self.path)
        self.sessions = [
            None
            if seg.model is None
            else open_session(seg.model, folder=self.path.parent, threads=threads, providers=providers)
            for seg in self.segments
        ]

    @property
    def collectives(self) -> list[Collective]:
        return [s.collective for s in self.segments if s.collective is not None]

    def run_segment(self, k: int, env: dict[str, np.ndarray]) -> None:
        seg, session = self.segments[k], self.sessions[k]
        if session is not None:
            results = session.run(seg.outputs, {name: env[name] for name in seg.inputs})
            env.update(zip(seg.outputs, results, strict=True))

    def run(self, feeds: dict[str, np.ndarray], collective: CollectiveFn) -> dict[str, np.ndarray]:
        env = dict(feeds)
        for k, seg in enumerate(self.segments):
            self.run_segment(k, env)
            if seg.collective is not None:
                env[seg.collective.output] = collective(seg.collective, env[seg.collective.input])
            for name in seg.release:
                env.pop(name, None)
        return {name: env[name] for name in self.outputs}


def _feeds(program: RankProgram, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """input_ids alone, or every input a third-party graph has (attention mask of ones, positions, an
    empty KV cache with this rank's KV heads: passes.graph_inputs reads the rank graph's declared shapes)."""
    if len(program.inputs) == 1:
        return {program.inputs[0]: np.ascontiguousarray(tokens, dtype=np.int64)}
    feeds = Signature.of(program.path).feeds(tokens)
    return {name: feeds[name] for name in program.inputs}


def _combine(collective: Collective, parts: Sequence[np.ndarray]) -> np.ndarray:
    if collective.operation == "all_reduce":
        if collective.reduce_op not in ("sum", ""):
            raise UserError(f"all_reduce with reduce_op={collective.reduce_op!r} is not supported")
        total = np.array(parts[0], copy=True)
        for p in parts[1:]:
            total += p
        return total
    if collective.operation == "all_gather":
        return np.concatenate(parts, axis=0)
    raise UserError(f"DistCollective {collective.operation!r} is not supported by the CPU runtime")


def run_simulated(
    rank_files: Sequence[str | Path] | str | Path, tokens: np.ndarray, threads: int = 1
) -> np.ndarray:
    """All ranks in this process, in lockstep; collectives summed here. Returns rank 0's first output."""
    if isinstance(rank_files, str | Path):
        rank_files = rank_onnx_files(rank_files)
    programs = [RankProgram(f, threads) for f in rank_files]
    counts = {len(p.segments) for p in programs}
    if len(counts) != 1:
        raise UserError(f"rank graphs differ in their number of collectives: {sorted(counts)}")
    envs = [_feeds(p, tokens) for p in programs]
    for k in range(counts.pop()):
        for p, env in zip(programs, envs, strict=True):
            p.run_segment(k, env)
        collective = programs[0].segments[k].collective
        if collective is not None:
            parts = [env[p.segments[k].collective.input] for p, env in zip(programs, envs, strict=True)]
            combined = _combine(collective, parts)
            for p, env in zip(programs, envs, strict=True):
                env[p.segments[k].collective.output] = combined
        for p, env in zip(programs, envs, strict=True):
            for name in p.segments[k].release:
                env.pop(name, None)
    return envs[0][programs[0].outputs[0]]


def torch_collective(world_size: int, device: str | None = None) -> CollectiveFn:
    """Collectives through torch.distributed (the process group must be initialized); `device` "cuda"
    moves each tensor to this process's GPU first (NCCL reduces CUDA tensors only)."""
    import torch  # noqa: PLC0415 (torch only in the processes that join a group; the single-process paths never do)
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the processes that join a group)

    def run(collective: Collective, array: np.ndarray) -> np.ndarray:
        if collective.nb_rank and collective.nb_rank != world_size:
            raise UserError(
                f"the rank graph was sharded for {collective.nb_rank} ranks, world size is {world_size}"
            )
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if device is not None:
            tensor = tensor.to(device)
        if collective.operation == "all_reduce":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            return tensor.cpu().numpy()
        if collective.operation == "all_gather":
            parts = [torch.empty_like(tensor) for _ in range(world_size)]
            dist.all_gather(parts, tensor)
            return torch.cat(parts, dim=0).cpu().numpy()
        raise UserError(f"DistCollective {collective.operation!r} is not supported by the CPU runtime")

    return run


def torchrun_rank(directory: str | Path, tp: int) -> tuple[int, int]:
    """(rank, world size) in the process group the caller joined (runtime.tp.gloo.torchrun_group),
    checked against the folder's rank count."""
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the processes that join a group)

    if not dist.is_initialized():
        raise UserError("no process group: join the torchrun launch first (runtime.tp.gloo.torchrun_group)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != tp:
        raise UserError(f"{directory} holds {tp} ranks; launch with --nproc-per-node {tp}")
    return rank, world


def run_distributed(directory: str | Path, tokens: np.ndarray, threads: int = 1) -> np.ndarray | None:
    """This process's rank of a torchrun launch (gloo, joined by the caller); the logits on rank 0, None
    elsewhere."""
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the processes that join a group)

    manifest = read_manifest(directory)
    files = rank_onnx_files(directory)
    rank, world = torchrun_rank(directory, manifest["tp"])
    program = RankProgram(files[rank], threads)
    outputs = program.run(_feeds(program, tokens), torch_collective(world))
    dist.barrier()
    return outputs[program.outputs[0]] if rank == 0 else None


def _gloo_worker(rank: int, world: int, port: int, directory: str, tokens: np.ndarray, out: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the processes that join a group)

    die_with_parent()
    init_gloo(rank, world, port)
    try:
        program = RankProgram(rank_onnx_files(directory)[rank], threads=1)
        outputs = program.run(_feeds(program, tokens), torch_collective(world))
        if rank == 0:
            np.save(out, outputs[program.outputs[0]])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(directory: str | Path, tokens: np.ndarray) -> np.ndarray:
    """Every rank of a TP folder in its own process (torch.multiprocessing), all-reducing over gloo on
    127.0.0.1, as the server's ranks do; rank 0's first output."""
    import torch.multiprocessing as mp  # noqa: PLC0415 (torch only where ranks are launched)

    world = int(read_manifest(directory)["tp"])
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "logits.npy")
        args = (world, free_port(), str(directory), tokens, out)
        mp.spawn(_gloo_worker, args=args, nprocs=world, join=True)
        return np.load(out)


def reference_error(model: str | Path, tokens: np.ndarray, logits: np.ndarray) -> float:
    """Max-abs relative error of tensor-parallel `logits` against the single-device `model` on `tokens`."""
    session = open_session(model, threads=1)
    reference = session.run(None, {session.get_inputs()[0].name: tokens})[0]
    return max_abs_relative_error(logits, reference)
