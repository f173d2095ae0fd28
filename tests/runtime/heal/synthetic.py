"""The synthetic model the heal tests share: built, fused with each norm mode and healed once per run
(fixtures `synthetic` and `folded` in conftest.py), and heal.py's one-line error check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.pipeline import fuse_file
from passes.plan import Plan
from runtime.heal.metadata import HealConfig
from runtime.heal.report import run_heal

# Groups starting at an attention block (its attention stays) and a plain block between the groups.
BLOCKS = [(True, 48), (True, 64), (False, 40), (True, 32), (True, 56), (False, 24), (False, 40)]
PLAN_GROUPS = ((1, 2), (4, 6))
SMALL = HealConfig(steps=20, lr=3e-3, batch_tokens=256)


def _ids(folder: Path, name: str, count: int, seed: int) -> Path:
    path = folder / name
    np.save(path, np.random.default_rng(seed).integers(0, 64, count, dtype=np.int64))
    return path


_models: dict[str, tuple] = {}


def healed_model(mode: str, tmp_path_factory) -> tuple:
    """(folder, original, fused, report) for the synthetic model fused with `mode`, healed once per run."""
    if mode not in _models:
        folder = tmp_path_factory.mktemp(f"heal_{mode}")
        original = build_synthetic(SyntheticSpec(hidden=32, blocks=BLOCKS, seed=5), folder / "m.onnx")
        fused = fuse_file(original, Plan(PLAN_GROUPS, mode), folder / "m.fused.onnx").output
        calib, held = _ids(folder, "calib.npy", 2048, 1), _ids(folder, "held.npy", 512, 2)
        report = run_heal(
            original, fused, folder / "m.healed.onnx", SMALL, calib=[calib], heldout=[held], window=64
        )
        _models[mode] = (folder, original, fused, report)
    return _models[mode]


def assert_one_line_error(
    tool: Callable, folder: Path, tmp_path: Path, cases: dict[str, tuple[list, str]]
) -> None:
    """heal.py on each case's arguments: exit 2 with one `error: ` line holding the case's message, and
    nothing written (no output, no staging folder)."""
    for name, (args, message) in cases.items():
        out = tmp_path / f"{name.replace(' ', '_')}.onnx"
        result = tool("heal", *args, "--heldout", folder / "held.npy", "--window", 64, "-o", out)
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (name, lines)
        assert not out.exists() and not list(tmp_path.glob(f".{out.name}*"))
