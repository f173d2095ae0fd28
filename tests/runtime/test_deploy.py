"""runtime.deploy: engine profiles come from the model's own static dims."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from exporters.tensorrt.build import Profile
from runtime.deploy import EngineRequest, build_engines
from tests import fp8_fixtures as fx


def _static_batch_copy(src: Path, folder: Path) -> Path:
    """The model with input_ids' batch dim fixed to 1, as some exporters write it."""
    model = onnx.load(str(src), load_external_data=False)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    target = folder / src.name
    onnx.save(model, str(target))
    (folder / (src.name + ".data")).symlink_to(src.with_name(src.name + ".data"))
    return target


def test_static_batch_is_kept_in_the_profile(tmp_path, tmp_path_factory):
    src = _static_batch_copy(fx.model_path("tiny_llama", tmp_path_factory), tmp_path)
    request = EngineRequest(
        models=[src], out=tmp_path / "out", profile=Profile((1, 1), (1, 16), (4, 64)), workspace_mb=256
    )
    (built,) = build_engines(request, log=lambda _: None)
    side = json.loads(built.sidecar_path.read_text())
    assert side["profile"]["input_ids"] == {"min": [1, 1], "opt": [1, 16], "max": [1, 64]}
