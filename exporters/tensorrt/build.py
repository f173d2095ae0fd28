"""Build one TensorRT engine from one ONNX file and write its JSON sidecar.

Networks are strongly typed: the Q/DQ in the graph decide the precision. `build_engine` parses from
file (so external data works), adds one optimization profile that covers every dynamic input (see
`DimRanges`: each named dynamic dim of the ONNX inputs, batch / seq / past_len / total, gets its range,
so decode graphs with a KV cache and their tensor-parallel rank graphs build too; past_len may start at
0, an empty cache), limits the workspace, loads and saves a timing cache (datacenter TensorRT;
TensorRT-RTX has none), builds with detailed profiling verbosity, and writes `<engine>.json`: TensorRT
flavor and version, compute capability, profile, input and output names and dtypes, sha256 of the ONNX
including its external data. exporters.tensorrt.check compares a built engine with ONNX Runtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from exporters.tensorrt import shim as trt_shim
from passes.errors import UserError

SIDECAR_FORMAT = "ffn-fusion-trt-engine/1"
DEFAULT_INPUT = "input_ids"


Range = tuple[int, int, int]  # min, opt, max of one dimension


@dataclass(frozen=True)
class Profile:
    """min/opt/max shapes of one input (for input_ids: (batch, seq)). A dim may be 0 (an empty KV cache)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise UserError(f"profile shapes differ in rank: {self.min} {self.opt} {self.max}")
        for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
            if not 0 <= lo <= mid <= hi:
                raise UserError(
                    f"profile needs 0 <= min <= opt <= max per dim, got {self.min}/{self.opt}/{self.max}"
                )

    @classmethod
    def batch_seq(cls, batch: Sequence[int], seq: Sequence[int]) -> Profile:
        if len(batch) != 3 or len(seq) != 3:
            raise UserError("batch and seq ranges take three numbers: min,opt,max")
        return cls(min=(batch[0], seq[0]), opt=(batch[1], seq[1]), max=(batch[2], seq[2]))


# Names exporters give dynamic dims (ONNX dim_param), by role. exporters/decode.py writes batch, seq,
# past_len and total (= past_len + seq); the prefill-only exports write batch and seq.
DIM_ALIASES = {
    "batch": ("batch", "batch_size"),
    "seq": ("seq", "seq_len", "sequence", "sequence_length"),
    "past": ("past_len", "past", "past_seq_len", "past_sequence_length"),
    "total": ("total", "total_len", "total_sequence_length", "past_len + seq", "seq + past_len"),
}


@dataclass(frozen=True)
class DimRanges:
    """min/opt/max of every named dynamic dim: one optimization profile for all inputs of a graph.

    `seq` is the number of tokens per call, `past` the cached tokens before it (0 = prefill from an
    empty cache), `total` = past + seq (the attention mask). Unset `past` defaults to (0, 0, seq max - 1):
    prompts of up to seq max tokens, then decoding until the cache and the new token make seq max.
    Unset `total` is (seq min + past min, seq opt + past opt, max(seq max, past max + seq min)).
    `extra` gives other dim names their ranges.
    """

    batch: Range
    seq: Range
    past: Range | None = None
    total: Range | None = None
    extra: Mapping[str, Range] = field(default_factory=dict)

    def __post_init__(self) -> None:
        given = {"batch": self.batch, "seq": self.seq, "past": self.past, "total": self.total, **self.extra}
        for name, value in given.items():
            if value is None:
                continue
            if len(value) != 3:
                raise UserError(f"the range of {name} takes three numbers: min,opt,max")
            Profile((value[0],), (value[1],), (value[2],))  # the same checks, one dim at a time

    @classmethod
    def from_profile(cls, main: Profile, past: Range | None = None) -> DimRanges:
        """Ranges from a (batch, seq) profile of input_ids."""
        if len(main.min) != 2:
            raise UserError(f"a (batch, seq) profile has two dims, got {list(main.min)}")
        return cls(
            batch=(main.min[0], main.opt[0], main.max[0]),
            seq=(main.min[1], main.opt[1], main.max[1]),
            past=past,
        )

    @classmethod
    def decode(cls, max_batch: int = 4, max_total: int = 2048, opt_total: int = 256) -> DimRanges:
        """A decode engine tuned for single-token steps with opt_total cached + new tokens: batch 1..max,
        seq 1..max_total (opt 1), past_len 0..max_total - 1, total 1..max_total."""
        opt_total = max(1, min(opt_total, max_total))
        return cls(
            batch=(1, 1, max_batch),
            seq=(1, 1, max_total),
            past=(0, opt_total - 1, max_total - 1),
            total=(1, opt_total, max_total),
        )

    def named(self) -> dict[str, Range]:
        seq = self.seq
        past = self.past if self.past is not None else (0, 0, max(seq[2] - 1, 0))
        total = self.total or (seq[0] + past[0], seq[1] + past[1], max(seq[2], past[2] + seq[0]))
        out = {"batch": self.batch, "seq": seq, "past": past, "total": total}
        return {**out, **dict(self.extra)}

    def lookup(self, dim_name: str) -> Range | None:
        if dim_name in self.extra:
            return tuple(self.extra[dim_name])  # type: ignore[return-value]
        named = self.named()
        for role, aliases in DIM_ALIASES.items():
            if dim_name in aliases:
                return named[role]
        return None


def onnx_input_dims(onnx_path: str | Path) -> dict[str, list[int | str | None]]:
    """Each graph input's dims: an int when static, the dim_param name, or None when unnamed/unknown."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    out: dict[str, list[int | str | None]] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims: list[int | str | None] = []
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or None)
        out[value.name] = dims
    return out


def input_profiles(
    onnx_path: str | Path, ranges: DimRanges, explicit: Mapping[str, Profile] | None = None
) -> dict[str, Profile]:
    """A profile for every dynamic input of an ONNX graph: `explicit` ones as given, the others from the
    names of their dynamic dims (static dims stay fixed). A dynamic dim without a known name is an error,
    except in rank-2 inputs, which take (batch, seq) like input_ids."""
    explicit = dict(explicit or {})
    out: dict[str, Profile] = {}
    for name, dims in onnx_input_dims(onnx_path).items():
        if all(isinstance(d, int) for d in dims):
            continue
        if name in explicit:
            out[name] = _pin_static(explicit[name], dims)
            continue
        picked: list[Range] = []
        for axis, d in enumerate(dims):
            if isinstance(d, int):
                picked.append((d, d, d))
                continue
            found = ranges.lookup(d) if d is not None else None
            if found is None and len(dims) == 2:
                found = ranges.batch if axis == 0 else ranges.seq
            if found is None:
                raise UserError(
                    f"input {name} has dynamic dim {axis} ({d or 'unnamed'}) of shape {dims}; give it a "
                    "profile or a range for that dim name"
                )
            picked.append(found)
        out[name] = Profile(*(tuple(r[k] for r in picked) for k in range(3)))
    return out


def _pin_static(profile: Profile, dims: Sequence[int | str | None]) -> Profile:
    """`profile` with the graph's static dims kept (a model exported with batch 1 builds for batch 1)."""
    if len(profile.min) != len(dims):
        return profile  # _add_profile reports the rank mismatch

    def pinned(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else s for s, d in zip(shape, dims, strict=True))

    return Profile(pinned(profile.min), pinned(profile.opt), pinned(profile.max))


@dataclass
class EngineBuild:
    engine_path: Path
    sidecar_path: Path
    sidecar: dict[str, Any]
    build_seconds: float
    plan_bytes: int
    warnings: list[str] = field(default_factory=list)


def sidecar_path(engine_path: str | Path) -> Path:
    engine_path = Path(engine_path)
    return engine_path.with_name(engine_path.name + ".json")


def onnx_sha256(path: str | Path) -> str:
    """sha256 over the .onnx bytes and then each external data file it references (sorted, once each)."""
    path = Path(path)
    digest = hashlib.sha256()
    _hash_file(digest, path)
    model = onnx.load(str(path), load_external_data=False)
    locations = set()
    for tensor in _all_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(e.value for e in tensor.external_data if e.key == "location")
    for location in sorted(locations):
        file = path.parent / location
        if not file.is_file():
            raise UserError(f"{path} references external data {location!r}, which is missing")
        digest.update(location.encode())
        _hash_file(digest, file)
    return digest.hexdigest()


def _hash_file(digest: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)


def _all_tensors(graph: onnx.GraphProto) -> Iterable[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            for sub in [attr.g, *attr.graphs] if attr.type in (5, 10) else []:
                yield from _all_tensors(sub)


def _format_parser_error(error: Any) -> str:
    where = []
    if error.node() >= 0:
        where.append(f"node {error.node()}")
    if error.node_name():
        where.append(error.node_name())
    if error.node_operator():
        where.append(f"({error.node_operator()})")
    prefix = " ".join(where)
    return f"{prefix}: {error.desc()}" if prefix else str(error.desc())


def parse_onnx(trt: trt_shim.Trt, builder: Any, onnx_path: Path, logger: trt_shim.Logger) -> tuple[Any, Any]:
    """Parse into a strongly typed network; every parser error goes into one UserError.

    Returns (network, parser): keep the parser alive until the build, it owns the weights.
    """
    network = builder.create_network(trt.network_flags())
    parser = trt.module.OnnxParser(network, logger.handle)
    ok = parser.parse_from_file(str(onnx_path))
    errors = [_format_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
    if not ok or errors:
        errors = errors or logger.errors or ["parse_from_file returned False without an error"]
        raise UserError(
            f"TensorRT {trt.version} ({trt.flavor}) could not parse {onnx_path} "
            f"({len(errors)} error{'s' * (len(errors) != 1)}): " + " | ".join(errors)
        )
    return network, parser


def _io(network: Any, count: int, get: Any) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "dtype": t.dtype.name, "shape": [int(d) for d in t.shape]}
        for t in (get(i) for i in range(count))
    ]


def resolve_profiles(
    onnx_path: str | Path, profile: Profile | DimRanges | Mapping[str, Profile]
) -> dict[str, Profile]:
    """Per-input profiles for a graph from what build_engine was given (see build_engine)."""
    if isinstance(profile, DimRanges):
        return input_profiles(onnx_path, profile)
    profiles = {DEFAULT_INPUT: profile} if isinstance(profile, Profile) else dict(profile)
    main = profiles.get(DEFAULT_INPUT) or next(iter(profiles.values()), None)
    if main is None or len(main.min) != 2:
        return profiles  # nothing to derive the other inputs' ranges from
    return input_profiles(onnx_path, DimRanges.from_profile(main), profiles)


def _add_profile(builder: Any, network: Any, profiles: Mapping[str, Profile]) -> tuple[dict, Any]:
    profile = builder.create_optimization_profile()
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    used: dict[str, Profile] = {}
    for tensor in inputs:
        shape = [int(d) for d in tensor.shape]
        if all(d >= 0 for d in shape):
            continue
        chosen = profiles.get(tensor.name)
        if chosen is None:
            raise UserError(f"input {tensor.name} has dynamic shape {shape}; give it a profile")
        if len(chosen.min) != len(shape):
            raise UserError(f"input {tensor.name} has {len(shape)} dims, its profile {len(chosen.min)}")
        for dim, lo, hi in zip(shape, chosen.min, chosen.max, strict=True):
            if dim >= 0 and not lo == hi == dim:
                raise UserError(f"input {tensor.name} has static dim {dim}; the profile must keep it")
        profile.set_shape(tensor.name, chosen.min, chosen.opt, chosen.max)
        used[tensor.name] = chosen
    record = {name: {"min": list(p.min), "opt": list(p.opt), "max": list(p.max)} for name, p in used.items()}
    return record, profile


class _Progress:
    """Prints the builder's top-level phases to stderr (TensorRT's IProgressMonitor)."""

    @staticmethod
    def create(trt: Any) -> Any:
        class Monitor(trt.IProgressMonitor):
            def __init__(self) -> None:
                trt.IProgressMonitor.__init__(self)

            def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
                if parent_phase is None:
                    print(f"[build] {phase_name} ...", file=sys.stderr, flush=True)

            def step_complete(self, phase_name: str, step: int) -> bool:
                return True

            def phase_finish(self, phase_name: str) -> None:
                pass

        return Monitor()


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path | None = None,
    *,
    profile: Profile | DimRanges | Mapping[str, Profile],
    workspace_mb: int = 2048,
    timing_cache: str | Path | None = None,
    compute_capability: str | None = None,
    progress: bool = False,
    verbose: bool = False,
) -> EngineBuild:
    """Build a TensorRT engine from an ONNX file and write it with its JSON sidecar.

    `profile`: a (batch, seq) Profile of input_ids, from which every other dynamic input gets its
    shapes by dim name (`DimRanges.from_profile`: past_len 0..seq max - 1, total like seq); or
    `DimRanges`; or explicit per-input Profiles (the rest again derived from the input_ids one).
    """
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise UserError(f"ONNX file not found: {onnx_path}")
    engine_path = Path(engine_path) if engine_path else onnx_path.with_suffix(".engine")
    profiles = resolve_profiles(onnx_path, profile)
    trt = trt_shim.load()
    logger = trt.logger(verbose)
    builder = trt.module.Builder(logger.handle)
    network, _parser = parse_onnx(trt, builder, onnx_path, logger)
    config = builder.create_builder_config()
    target = trt.set_target(config, compute_capability)
    config.set_memory_pool_limit(trt.module.MemoryPoolType.WORKSPACE, int(workspace_mb) << 20)
    config.profiling_verbosity = trt.module.ProfilingVerbosity.DETAILED
    profile_record, trt_profile = _add_profile(builder, network, profiles)
    config.add_optimization_profile(trt_profile)
    collectives, preview = _dist_collective(trt, network, config)
    cache_record = _load_timing_cache(trt, config, timing_cache)
    if progress:
        config.progress_monitor = _Progress.create(trt.module)
    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if plan is None or plan.nbytes == 0:
        detail = " | ".join(logger.errors) or "no error message from TensorRT"
        raise UserError(f"TensorRT could not build an engine from {onnx_path}: {detail}")
    _save_timing_cache(trt, config, timing_cache)
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    engine_path.write_bytes(plan)
    sidecar = {
        "format": SIDECAR_FORMAT,
        "engine": engine_path.name,
        "engine_bytes": int(plan.nbytes),
        "onnx": os.path.relpath(onnx_path.resolve(), engine_path.parent.resolve()),
        "onnx_sha256": onnx_sha256(onnx_path),
        "tensorrt": {"flavor": trt.flavor, "version": trt.version},
        "compute_capability": target,
        "strongly_typed": trt.network_flags() != 0,
        "profiling_verbosity": "DETAILED",
        "workspace_mb": int(workspace_mb),
        "profile": profile_record,
        "inputs": _io(network, network.num_inputs, network.get_input),
        "outputs": _io(network, network.num_outputs, network.get_output),
        "dist_collective_layers": collectives,
        "preview_features": ["MULTIDEVICE_RUNTIME_10_16"] if preview else [],
        "timing_cache": cache_record,
        "build_seconds": round(seconds, 3),
    }
    side = sidecar_path(engine_path)
    side.write_text(json.dumps(sidecar, indent=2) + "\n")
    return EngineBuild(engine_path, side, sidecar, seconds, int(plan.nbytes))


def _dist_collective(trt: trt_shim.Trt, network: Any, config: Any) -> tuple[int, bool]:
    """(number of DistCollective layers, whether a preview feature was switched on for them)."""
    kind = trt.dist_collective_layer_type()
    count = 0 if kind is None else sum(network.get_layer(i).type == kind for i in range(network.num_layers))
    return count, bool(count) and trt.enable_dist_collective(config)


def _load_timing_cache(trt: trt_shim.Trt, config: Any, path: str | Path | None) -> str | None:
    if path is None or not trt.supports_timing_cache:
        return None
    path = Path(path)
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data)
    config.set_timing_cache(cache, ignore_mismatch=False)
    return str(path)


def _save_timing_cache(trt: trt_shim.Trt, config: Any, path: str | Path | None) -> None:
    if path is None or not trt.supports_timing_cache:
        return
    cache = config.get_timing_cache()
    if cache is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(memoryview(cache.serialize()))


def read_sidecar(engine_path: str | Path) -> dict[str, Any]:
    path = sidecar_path(engine_path)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read engine sidecar {path}: {exc}") from None
    if record.get("format") != SIDECAR_FORMAT:
        raise UserError(f"{path} is not an engine sidecar ({SIDECAR_FORMAT})")
    return record
