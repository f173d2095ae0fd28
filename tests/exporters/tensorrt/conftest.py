"""The FP8 models that the engine tests build and check (session-scoped: each is quantized once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from passes.io.model_io import load_model, save_model
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from tests import fp8_fixtures as fx


@pytest.fixture(scope="session")
def fp8_model(tmp_path_factory):
    """get(kind): the calibrated FP8 Q/DQ copy of fx.model_path(kind), with external data; once each."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            src = fx.model_path(kind, tmp_path_factory)
            scales = calibrate(src, fx.calib_batches(), progress=False)
            model = load_model(src)
            quantize_fp8(model, scales)
            out = tmp_path_factory.mktemp(f"fp8_{kind}") / f"{kind}_fp8.onnx"
            save_model(model, out, external=True)
            cache[kind] = out
        return cache[kind]

    return get
