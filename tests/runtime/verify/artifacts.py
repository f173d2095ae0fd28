"""Artifacts of every kind the verifier tells apart, built once per session from the project's own small
fixtures: the synthetic model fused and healed (tests/runtime/heal/synthetic.py), and the tiny Llama
(tests/decode_fixtures.py) fused, quantized to FP8, sharded for TP 2, and as a decode graph; and helpers
that tamper with copies of them. tests/tools/test_verify_tool.py imports these too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir

from passes.io.model_io import load_model, save_model
from passes.quant.calibrate import calibrate
from passes.shard import shard_file
from runtime.deploy import quantize_file
from tests import decode_fixtures
from tests.runtime.heal.synthetic import healed_model


def healed_artifacts(tmp_path_factory) -> dict[str, Path]:
    """{"original", "fused", "healed"}: the synthetic model, fused (norm "last") and healed."""
    folder, original, fused, _ = healed_model("last", tmp_path_factory)
    return {"original": original, "fused": fused, "healed": folder / "m.healed.onnx"}


_tiny: dict[str, Path] = {}


def tiny_artifacts(tmp_path_factory) -> dict[str, Path]:
    """{"prefill", "prefill_fused", "fused", "fp8", "tp2", "decode"}: the tiny Llama and its artifacts
    (built once per session)."""
    if not _tiny:
        _tiny.update(_build_tiny(tmp_path_factory))
    return _tiny


def _build_tiny(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.getbasetemp()
    models = {n: decode_fixtures.decode_models(base, n) for n in ("prefill", "prefill_fused", "decode")}
    folder = tmp_path_factory.mktemp("verify_tiny")
    fused = models["prefill_fused"]
    ids = np.random.default_rng(3).integers(0, decode_fixtures.tiny_spec().vocab, (2, 32), dtype=np.int64)
    fp8 = quantize_file(fused, calibrate(fused, [ids], progress=False), folder, False, lambda m: None)
    shard_file(fused, 2, folder / "tp2", progress=False)
    return {**models, "fused": fused, "fp8": fp8, "tp2": folder / "tp2"}


def with_metadata(source: Path, target: Path, key: str, change) -> Path:
    """A copy of `source` whose metadata `key` holds change(its JSON value)."""
    model = load_model(source)
    model.metadata_props[key] = json.dumps(change(json.loads(model.metadata_props[key])))
    save_model(model, target, external=True)
    return target


def tampered(source: Path, target: Path, name: str, change) -> Path:
    """A copy of `source` whose initializer `name` holds change(its array) (metadata kept)."""
    model = load_model(source)
    value = model.graph.initializers[name]
    old = value.const_value
    array = change(np.array(old.numpy()))
    value.const_value = ir.tensor(array, dtype=old.dtype, name=name)
    save_model(model, target, external=True)
    return target


def tampered_folder(source: Path, target: Path, rank: str, name: str, change) -> Path:
    """A copy of the rank folder `source` whose `rank` graph's initializer `name` holds change(array)."""
    shutil.copytree(source, target, ignore=lambda folder, names: names if Path(folder).name == rank else [])
    tampered(source / rank / "model.onnx", target / rank / "model.onnx", name, change)
    return target
