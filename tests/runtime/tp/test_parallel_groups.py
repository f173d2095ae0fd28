"""Parallel groups of blocks (paper section 6) under tensor parallelism over gloo: the tiny project model
with PLAN (full blocks 0-2 in one parallel group, FFN group [4, 5]), prefill and decode graphs sharded at
TP 2, 4 and 8 with two all-reduces for the group, every rank in its own process. The prefill logits equal
one device within 1e-5; the decode ranks generate the single device's tokens with its logits at every
step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from passes.error_measures import max_abs_relative_error
from passes.graph_inputs import Signature
from passes.shard import count_allreduces, rank_onnx_files, shard_file
from runtime.backends import OrtBackend, TpRankBackend
from runtime.ports import free_port
from runtime.tp.gloo import init_gloo
from runtime.tp.ort import RankProgram, torch_collective
from tests.passes.shard.test_parallel_groups import ALLREDUCES, TOLERANCE, parallel_models
from tests.passes.test_parallel import IDS
from tests.run_graph import graph_logits
from tests.runtime.tp.test_decode_puzzle import generate


@pytest.fixture(scope="session")
def parallel_tiny() -> dict[str, Path]:
    return parallel_models()


def _rank(rank: int, world: int, port: int, prefill: str, decode: str, out: str) -> None:
    init_gloo(rank, world, port)
    try:
        program = RankProgram(rank_onnx_files(prefill)[rank])
        logits = program.run(Signature.of(program.path).feeds(IDS), torch_collective(world))["logits"]
        tokens, steps = generate(TpRankBackend(decode, rank, world))
        if rank == 0:
            np.savez(out, logits=logits, tokens=np.array(tokens), steps=steps)
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


SLOW = pytest.mark.slow  # 4 and 8 processes each import torch and ONNX Runtime: ~30 and ~50 s here


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=SLOW), pytest.param(8, marks=SLOW)])
def test_parallel_group_over_gloo_equals_one_device(parallel_tiny, tmp_path: Path, tp: int) -> None:
    assert count_allreduces(parallel_tiny["prefill"]) == ALLREDUCES["original"]
    assert count_allreduces(parallel_tiny["prefill_plan"]) == ALLREDUCES["parallel"]
    dirs = {}
    for graph in ("prefill", "decode"):
        dirs[graph] = tmp_path / graph
        report = shard_file(parallel_tiny[f"{graph}_plan"], tp, dirs[graph], progress=False)
        assert report.allreduces_per_forward == ALLREDUCES["parallel"]
        assert all(count_allreduces(f) == ALLREDUCES["parallel"] for f in report.rank_files)
    out = tmp_path / "rank0.npz"
    mp.spawn(_rank, args=(tp, free_port(), str(dirs["prefill"]), str(dirs["decode"]), str(out)), nprocs=tp)
    result = np.load(out)
    expected = graph_logits(parallel_tiny["prefill_plan"], IDS)
    assert max_abs_relative_error(result["logits"], expected) <= TOLERANCE
    tokens, steps = generate(OrtBackend(parallel_tiny["decode_plan"]))
    assert result["tokens"].tolist() == tokens
    assert max_abs_relative_error(result["steps"], steps) <= TOLERANCE
    # The rewrite is not the identity here: the original model generates other logits.
    _, original = generate(OrtBackend(parallel_tiny["decode"]))
    assert max_abs_relative_error(original, steps) > 1e-3
