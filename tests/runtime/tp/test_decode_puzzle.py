"""TP 2 decoding of a Puzzle (Nemotron-NAS) decode graph over gloo: two rank processes, each holding its
share of caches whose KV heads differ per layer (2, 1 and 4; the 1-head layer padded to one slot per
rank), generate the single device's tokens with the single device's logits at every step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from passes.error_measures import max_abs_relative_error
from passes.graph_inputs import Signature
from passes.shard import rank_onnx_files
from runtime.backends import Backend, OrtBackend, TpRankBackend
from runtime.generate import DecodeModel, greedy_generate
from runtime.ports import free_port
from runtime.tp.gloo import init_gloo
from tests.exporters.hf_fixtures import PUZZLE_CACHE_HEADS, puzzle_models

TOLERANCE = 1e-5
PROMPTS = [[17, 41, 8, 60, 22, 9], [90, 5, 33]]
STEPS = 6


class Recording:
    """A backend that keeps the logits of every run (prefill, then each decode step)."""

    def __init__(self, backend: Backend) -> None:
        self.backend, self.logits = backend, []
        self.inputs, self.outputs, self.name = backend.inputs, backend.outputs, backend.name
        self.vocab = getattr(backend, "vocab", None)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.backend.run(feeds)
        self.logits.append(out["logits"][:, -1])
        return out


def generate(backend: Backend) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens and the last position's logits of every step [steps, batch, vocab]."""
    recording = Recording(backend)
    tokens = greedy_generate(DecodeModel(recording), PROMPTS, STEPS).tokens
    return tokens, np.stack(recording.logits)


def _rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    init_gloo(rank, world, port)
    try:
        tokens, logits = generate(TpRankBackend(folder, rank, world))
        if rank == 0:
            np.savez(out, tokens=np.array(tokens), logits=logits)
        dist.barrier()  # no rank tears gloo down while another still talks to it (SIGABRT at exit)
    finally:
        dist.destroy_process_group()


def test_tp2_decode_over_gloo_equals_one_device(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path):
    base = tmp_path_factory.getbasetemp()
    folder = puzzle_models(base, "decode_tp2")
    for rank_file in rank_onnx_files(folder):  # each rank's share: half a layer's heads, or its one slot
        shares = {i.layer: i.static(1) for i in Signature.of(rank_file).cache_inputs}
        assert shares == {layer: -(-kv // 2) for layer, kv in PUZZLE_CACHE_HEADS.items()}
    expected_tokens, expected_logits = generate(OrtBackend(puzzle_models(base, "decode")))
    out = tmp_path / "rank0.npz"
    mp.spawn(_rank, args=(2, free_port(), str(folder), str(out)), nprocs=2, join=True)
    result = np.load(out)
    assert result["tokens"].tolist() == expected_tokens
    assert result["logits"].shape == expected_logits.shape == (STEPS, 2, 96)
    assert max_abs_relative_error(result["logits"], expected_logits) <= TOLERANCE
