"""The one place that knows which TensorRT is installed.

Datacenter `tensorrt` (deployment machines, Hopper) is used if it imports, otherwise `tensorrt_rtx`
(TensorRT-RTX, on PyPI; it builds engines ahead of time for a chosen compute capability, also on a
machine without a GPU). The two Python APIs are the same apart from what this module wraps:

- target: TensorRT-RTX sets `num_compute_capabilities = 1` and `set_compute_capability(SM.., 0)`
  (default sm89, Ada, which has FP8; it has no SM90); datacenter TensorRT builds for the GPU it runs on.
- DistCollective: datacenter 10.16 <= version < 11 needs PreviewFeature.MULTIDEVICE_RUNTIME_10_16;
  11.x and TensorRT-RTX have it natively.
- timing cache: datacenter only (TensorRT-RTX's timing-cache calls are deprecated no-ops).
- precision: strongly typed networks everywhere (BuilderFlag.FP8 is gone in 11.x); the Q/DQ decide.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from passes.errors import UserError

INSTALL_HINT = (
    "TensorRT is not installed: `pip install tensorrt` on deployment machines (from NVIDIA's index, "
    "https://pypi.nvidia.com) or `pip install tensorrt-rtx-cu13` (PyPI, builds ahead of time for sm89)"
)
DEFAULT_RTX_COMPUTE_CAPABILITY = "sm89"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def parse_compute_capability(text: str) -> tuple[int, int]:
    """'sm89', 'sm_89', '8.9' or '89' -> (8, 9)."""
    cleaned = text.strip().lower().removeprefix("sm").lstrip("_")
    try:
        if "." in cleaned:
            major, minor = cleaned.split(".", 1)
            return int(major), int(minor)
        number = int(cleaned)
    except ValueError:
        raise UserError(f"bad compute capability {text!r} (use e.g. sm89 or 8.9)") from None
    return number // 10, number % 10


def cc_name(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


def _cudart() -> Any | None:
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def current_gpu_compute_capability() -> tuple[int, int] | None:
    """Compute capability of GPU 0, or None when there is no usable GPU."""
    cudart = _cudart()
    if cudart is not None:
        major, minor, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if cudart.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
            cudart.cudaDeviceGetAttribute(ctypes.byref(major), 75, 0)
            cudart.cudaDeviceGetAttribute(ctypes.byref(minor), 76, 0)
            return major.value, minor.value
        return None
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        first = out.stdout.strip().splitlines()[:1]
        if out.returncode == 0 and first:
            return parse_compute_capability(first[0])
    return None


@dataclass
class Logger:
    """A trt.ILogger that keeps errors (for UserError messages); prints errors and warnings if verbose."""

    trt: Any
    verbose: bool = False
    errors: list[str] = field(default_factory=list)
    handle: Any = None

    def __post_init__(self) -> None:
        outer, trt = self, self.trt

        class _Impl(trt.ILogger):
            def __init__(self) -> None:
                trt.ILogger.__init__(self)

            def log(self, severity: Any, msg: str) -> None:
                if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                    outer.errors.append(msg)
                    if outer.verbose:
                        print(f"[TensorRT] error: {msg}", file=sys.stderr)
                elif outer.verbose and severity == trt.ILogger.Severity.WARNING:
                    print(f"[TensorRT] warning: {msg}", file=sys.stderr)

        self.handle = _Impl()


@dataclass(frozen=True)
class Trt:
    """The installed TensorRT module and its flavor-specific calls."""

    module: ModuleType
    flavor: str  # "tensorrt" or "tensorrt_rtx"
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.flavor == "tensorrt_rtx"

    @property
    def supports_timing_cache(self) -> bool:
        return not self.is_rtx

    def network_flags(self) -> int:
        flag = getattr(self.module.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        return 0 if flag is None else 1 << int(flag)

    def logger(self, verbose: bool = False) -> Logger:
        return Logger(self.module, verbose=verbose)

    def set_target(self, config: Any, compute_capability: str | None) -> str:
        """Point the builder at a GPU generation; returns the compute capability as 'smXY'."""
        trt = self.module
        if self.is_rtx:
            cc = parse_compute_capability(compute_capability or DEFAULT_RTX_COMPUTE_CAPABILITY)
            member = getattr(trt.ComputeCapability, f"SM{cc[0]}{cc[1]}", None)
            if member is None:
                known = ", ".join(m.lower() for m in trt.ComputeCapability.__members__ if m.startswith("SM"))
                raise UserError(
                    f"TensorRT-RTX {self.version} cannot build for {cc_name(cc)} (it knows {known}); "
                    "Hopper (sm90) needs datacenter TensorRT"
                )
            config.num_compute_capabilities = 1
            config.set_compute_capability(member, 0)
            return cc_name(cc)
        device = current_gpu_compute_capability()
        if device is None:
            raise UserError("datacenter TensorRT builds for the GPU it runs on, and no GPU was found")
        if compute_capability and parse_compute_capability(compute_capability) != device:
            raise UserError(
                f"datacenter TensorRT builds for this machine's GPU ({cc_name(device)}), not "
                f"{compute_capability}; build on such a GPU or use TensorRT-RTX for ahead-of-time builds"
            )
        return cc_name(device)

    def enable_dist_collective(self, config: Any) -> bool:
        """Allow DistCollective layers; True when a preview feature had to be switched on."""
        if self.is_rtx:
            return False
        version = _version_tuple(self.version)
        feature = getattr(self.module.PreviewFeature, "MULTIDEVICE_RUNTIME_10_16", None)
        if (10, 16) <= version < (11,) and feature is not None:
            config.set_preview_feature(feature, True)
            return True
        if version < (10, 16):
            raise UserError(f"DistCollective needs TensorRT 10.16 or newer (installed: {self.version})")
        return False

    def dist_collective_layer_type(self) -> Any | None:
        return getattr(self.module.LayerType, "DIST_COLLECTIVE", None)


@functools.cache
def load() -> Trt:
    """Datacenter `tensorrt` if it imports, else `tensorrt_rtx`; UserError naming the pip packages."""
    for name in ("tensorrt", "tensorrt_rtx"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not hasattr(module, "Builder"):  # the PyPI stub of `tensorrt` that failed to download
            continue
        return Trt(module=module, flavor=name, version=str(module.__version__))
    raise UserError(INSTALL_HINT)


def require_gpu_runtime() -> Trt:
    """For running engines (--check): datacenter TensorRT and a GPU, else a UserError."""
    trt = load()
    if trt.is_rtx:
        raise UserError(
            "--check runs the engine, which needs datacenter TensorRT (`pip install tensorrt` from NVIDIA's "
            "index) and a GPU; only TensorRT-RTX is installed here (it builds ahead of time, it does not run)"
        )
    if current_gpu_compute_capability() is None:
        raise UserError("--check runs the engine and needs a GPU; none was found")
    return trt


@dataclass
class OpenEngine:
    """A deserialized engine with one execution context, and its I/O tensor names."""

    trt: Trt
    runtime: Any
    engine: Any
    context: Any
    inputs: list[str]
    outputs: list[str]


def open_engine(engine_path: str | Path, hint: str = "") -> OpenEngine:
    """Deserialize an engine on this process's GPU (datacenter TensorRT or TensorRT-RTX runtime)."""
    trt = require_gpu_runtime()
    path = Path(engine_path)
    if not path.is_file():
        raise UserError(f"engine {path} does not exist{hint}")
    module = trt.module
    runtime = module.Runtime(module.Logger(module.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise UserError(f"TensorRT could not deserialize {path} (built for another GPU or version?)")
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    is_input = {n: engine.get_tensor_mode(n) == module.TensorIOMode.INPUT for n in names}
    inputs, outputs = [n for n in names if is_input[n]], [n for n in names if not is_input[n]]
    return OpenEngine(trt, runtime, engine, engine.create_execution_context(), inputs, outputs)
