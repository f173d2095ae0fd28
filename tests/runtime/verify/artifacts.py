"""Artifacts of every kind the verifier tells apart, built once per session from the project's own small
fixtures: the synthetic model fused and healed (tests/runtime/heal/synthetic.py), and the tiny Llama
(tests/decode_fixtures.py) fused, quantized to FP8, sharded for TP 2, and as a decode graph; the every-kind
Nemotron-NAS checkpoint (exporters/hf/synthetic.py) fused and exported as a checkpoint; and helpers that
tamper with copies of them. tests/tools/test_verify_tool.py imports these too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir

from exporters.hf.checkpoint import export_hf
from exporters.hf.safetensors_in import numpy_dtype, open_checkpoint
from exporters.hf.synthetic import write_all_kinds
from exporters.nas.export import export_checkpoint
from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.io.model_io import load_model, save_model
from passes.metadata import HEAL_METADATA_KEY
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.quant.calibrate import calibrate
from passes.shard import shard_file
from runtime.deploy import quantize_file
from runtime.heal.metadata import TENSOR_HASHES_KEY
from runtime.verify.common import tensor_sha256
from tests import decode_fixtures
from tests.runtime.heal.synthetic import BLOCKS, healed_model


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
    models = {n: decode_fixtures.decode_models(n) for n in ("prefill", "prefill_fused", "decode")}
    folder = tmp_path_factory.mktemp("verify_tiny")
    fused = models["prefill_fused"]
    ids = np.random.default_rng(3).integers(0, decode_fixtures.tiny_spec().vocab, (2, 32), dtype=np.int64)
    fp8 = quantize_file(fused, calibrate(fused, [ids], progress=False), folder, False, lambda m: None)
    shard_file(fused, 2, folder / "tp2", progress=False)
    return {**models, "fused": fused, "fp8": fp8, "tp2": folder / "tp2"}


def parallel_artifacts(folder: Path) -> dict[str, Path]:
    """{"original", "healed"}: the heal tests' synthetic model fused with FFN group [1, 2] and parallel group
    [3, 4] (blocks 2-3 of the fused graph), carrying a heal record of the parallel members' FFN weights: a
    healed graph's form without a heal's 20 s (a real parallel heal: tests/runtime/heal/test_parallel.py)."""
    original = build_synthetic(SyntheticSpec(hidden=32, blocks=BLOCKS, seed=5), folder / "m.onnx")
    plan = parse_plan({"groups": [[1, 2]], "parallel_blocks": [[3, 4]]})
    model = load_model(fuse_file(original, plan, folder / "m.fused.onnx").output)
    members = [b for b in find_blocks(model) if b.parallel is not None]
    names = {w.source.name for b in members for w in (b.ffn.gate, b.ffn.up, b.ffn.down)}
    hashes = {n: tensor_sha256(model.graph.initializers[n].const_value) for n in sorted(names)}
    model.metadata_props[HEAL_METADATA_KEY] = json.dumps({TENSOR_HASHES_KEY: hashes})
    save_model(model, folder / "m.healed.onnx", external=True)
    return {"original": original, "healed": folder / "m.healed.onnx"}


_checkpoints: dict[str, Path] = {}


def checkpoint_artifacts(tmp_path_factory) -> dict[str, Path]:
    """{"source", "graph", "fused", "fused_fp8", "float32", "bfloat16", "fp8", "fp8_tensor"}: the every-kind
    checkpoint (as
    tests/exporters/hf/test_nas_export.py builds it), its float32 graph, that fused (norm "fold": the fused
    layers' weights are new values, not copies), the fused graph quantized to FP8 (build_engines --fp8's
    quantize_file), and the fused graph exported as a Nemotron-NAS checkpoint in float32, bfloat16 and FP8
    (per-channel, and per-tensor with the calibration's activation scales)."""
    if not _checkpoints:
        base = tmp_path_factory.mktemp("verify_checkpoint")
        source = write_all_kinds(base / "ckpt", seed=7, vocab=96)
        graph = base / "onnx" / "model.onnx"
        export_hf(source, graph, dtype="float32")
        plan = parse_plan({"groups": [[1, 4], [9, 10]], "norm": "fold"})
        fused = fuse_file(graph, plan, base / "fused" / "model.onnx").output
        _checkpoints.update(source=source, graph=graph, fused=fused)
        for dtype in ("float32", "bfloat16"):
            _checkpoints[dtype] = export_checkpoint(fused, source, base / dtype, dtype=dtype).output
        _checkpoints["fp8"] = export_checkpoint(fused, source, base / "fp8", fp8="per-channel").output
        ids = np.random.default_rng(3).integers(0, 96, (2, 16), dtype=np.int64)
        scales = calibrate(fused, [ids], progress=False)
        _checkpoints["fused_fp8"] = quantize_file(fused, scales, base / "fused", False, lambda m: None)
        scales.save(base / "scales.json")
        _checkpoints["fp8_tensor"] = export_checkpoint(
            fused, source, base / "fp8_tensor", fp8="per-tensor", fp8_scales=base / "scales.json"
        ).output
    return _checkpoints


def tampered_checkpoint(source: Path, target: Path, name: str, change) -> Path:
    """A copy of the checkpoint folder `source` whose safetensors tensor `name` holds change(its array),
    written in place in its shard."""
    shutil.copytree(source, target)
    entry = open_checkpoint(target).tensors[name]
    with open(entry.file, "r+b") as f:
        f.seek(entry.start)
        dtype = np.uint8 if entry.dtype == "F8_E4M3" else numpy_dtype(entry.numpy_name)  # float8 as its bits
        array = np.frombuffer(f.read(entry.end - entry.start), dtype=dtype)
        changed = np.ascontiguousarray(change(array.copy()).astype(array.dtype))
        f.seek(entry.start)
        f.write(changed.tobytes())
    return target


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
