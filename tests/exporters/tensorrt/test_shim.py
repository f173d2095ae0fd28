"""The one TensorRT shim (exporters/tensorrt/shim.py): targets, refusals, the missing-package message."""

from __future__ import annotations

import sys

import pytest

from exporters.tensorrt import shim as trt_shim
from passes.errors import UserError


def test_shim_targets_and_refusals():
    trt = trt_shim.load()
    assert trt.flavor in ("tensorrt", "tensorrt_rtx") and trt.version == trt.module.__version__
    assert trt_shim.parse_compute_capability("sm89") == (8, 9) == trt_shim.parse_compute_capability("8.9")
    assert trt_shim.parse_compute_capability("sm_120") == (12, 0)
    with pytest.raises(UserError, match="bad compute capability"):
        trt_shim.parse_compute_capability("ada")
    if not trt.is_rtx:
        pytest.skip("ahead-of-time targets are TensorRT-RTX's")
    config = trt.module.Builder(trt.logger().handle).create_builder_config()
    assert trt.set_target(config, None) == "sm89"
    assert config.num_compute_capabilities == 1
    assert config.get_compute_capability(0) == trt.module.ComputeCapability.SM89
    assert trt.set_target(config, "sm86") == "sm86"
    with pytest.raises(UserError, match="sm90.*datacenter"):
        trt.set_target(config, "sm90")
    assert trt.enable_dist_collective(config) is False  # native in TensorRT-RTX
    assert not trt.supports_timing_cache


def test_missing_tensorrt_names_both_packages(monkeypatch):
    trt_shim.load.cache_clear()
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` raise ImportError
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    try:
        with pytest.raises(UserError) as info:
            trt_shim.load()
    finally:
        trt_shim.load.cache_clear()
    message = str(info.value)
    assert "pip install tensorrt`" in message and "tensorrt-rtx-cu13" in message and "\n" not in message
