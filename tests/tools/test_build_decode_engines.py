"""tools/build_engines.py on decode graphs (KV cache, past_len from 0) and on their tensor-parallel ranks.

TensorRT-RTX builds ahead of time for sm89 here; running the engines needs a GPU (runtime.backends).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporters.tensorrt import shim as trt_shim
from exporters.tensorrt.build import DimRanges, Profile, input_profiles, resolve_profiles
from passes.errors import UserError
from tests import decode_fixtures

SHAPES = ["--batch", "1,1,2", "--seq", "1,16,64", "--workspace-mb", "256"]
CACHE = [f"past_{k}_{layer}" for layer in decode_fixtures.TINY_CACHE_LAYERS for k in ("key", "value")]


@pytest.fixture(scope="module")
def fused_decode(tmp_path_factory) -> Path:
    return decode_fixtures.decode_models("decode_fused")


def _require_trt() -> None:
    try:
        trt_shim.load()
    except UserError:
        pytest.skip("no TensorRT installed")


def test_profiles_for_every_dynamic_input(fused_decode: Path) -> None:
    """From the (batch, seq) profile of input_ids, by dim name: past_len from 0 to seq max - 1."""
    main = Profile(min=(1, 1), opt=(1, 16), max=(2, 64))
    profiles = resolve_profiles(fused_decode, main)
    assert sorted(profiles) == sorted(["input_ids", "attention_mask", *CACHE])
    assert profiles["input_ids"] == main
    assert profiles["attention_mask"] == Profile((1, 1), (1, 16), (2, 64))  # total = past_len + seq
    assert profiles["past_key_4"] == Profile((1, 2, 0, 16), (1, 2, 0, 16), (2, 2, 63, 16))
    ranges = DimRanges(batch=(1, 1, 2), seq=(1, 1, 8), past=(0, 100, 200))
    past = input_profiles(fused_decode, ranges)["past_value_0"]
    assert (past.min, past.opt, past.max) == ((1, 2, 0, 16), (1, 2, 100, 16), (2, 2, 200, 16))
    assert input_profiles(fused_decode, ranges)["attention_mask"].max == (2, 201)
    with pytest.raises(UserError, match="min <= opt <= max"):
        DimRanges(batch=(1, 1, 2), seq=(1, 1, 8), past=(0, 9, 4))


def test_cli_builds_decode_engine_and_rank_engines(fused_decode: Path, tmp_path: Path, tool) -> None:
    _require_trt()
    out = tmp_path / "single"
    result = tool("build_engines", fused_decode, *SHAPES, "--out", out)
    assert result.returncode == 0, result.stderr
    side = json.loads((out / "tiny_decode_fused.engine.json").read_text())
    assert side["profile"]["past_key_4"] == {
        "min": [1, 2, 0, 16],
        "opt": [1, 2, 0, 16],
        "max": [2, 2, 63, 16],
    }
    assert side["profile"]["attention_mask"] == {"min": [1, 1], "opt": [1, 16], "max": [2, 64]}
    assert [i["name"] for i in side["inputs"]] == ["input_ids", "attention_mask", *CACHE]
    assert side["engine_bytes"] == (out / "tiny_decode_fused.engine").stat().st_size > 0

    out = tmp_path / "tp2"
    result = tool("build_engines", fused_decode, "--tp", "2", *SHAPES, "--out", out)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        side = json.loads((out / f"rank{rank}.engine.json").read_text())
        # one of the 2 KV heads per rank; 2 attention + 3 FFN branches (fused): 5 all-reduces
        assert side["profile"]["past_value_0"] == {
            "min": [1, 1, 0, 16],
            "opt": [1, 1, 0, 16],
            "max": [2, 1, 63, 16],
        }
        assert side["dist_collective_layers"] == 5
        assert (out / f"rank{rank}.engine").stat().st_size == side["engine_bytes"] > 0
