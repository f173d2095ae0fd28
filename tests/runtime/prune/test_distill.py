"""runtime/prune/distill.py, importance.py and report.py on a tiny Llama: the local refit beats surgery,
the Linear replacement is fitted, end-to-end steps lower the KL, importance is the skipped-attention KL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.prune.distill import distill_local, end_to_end
from runtime.prune.importance import attention_importance, cheapest_runs, kl_per_position
from runtime.prune.model import load_checkpoint
from runtime.prune.report import format_report, score
from runtime.prune.tradeoff import format_tradeoff, measure_tradeoff, plot_tradeoff
from runtime.text_sets import TextSet
from tests.runtime.prune.fixtures import VOCAB, write_tiny_llama

LAYERS = [2, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_checkpoint(write_tiny_llama(tmp_path_factory.mktemp("llama") / "ckpt"))


def windows(seed: int, rows: int = 16, seq: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, VOCAB, size=(rows, seq))


def test_importance_is_the_kl_without_each_attention(model) -> None:
    ids = windows(5, rows=3, seq=32)
    importance = attention_importance(model, ids, batch=2)
    assert sorted(importance) == list(range(6))
    with torch.no_grad():
        t = torch.from_numpy(ids)
        direct = float(kl_per_position(model.forward(t), model.forward(t, skip_attention=4))) / ids.size
    assert importance[4] == pytest.approx(direct, rel=1e-4)
    runs = cheapest_runs(importance, range(2, 4))
    assert [r.last - r.first for r in runs] == [1, 2]


def test_local_refit_beats_surgery(model) -> None:
    distilled, surgery = model.copy(), model.copy()
    for i in LAYERS:
        surgery.remove_attention(i)
    fits = distill_local(model, distilled, LAYERS, windows(0), ridge=0.1)
    assert [f.layer for f in fits] == LAYERS and all(f.after < 0.9 * f.before for f in fits)
    assert [k.attention for k in distilled.kinds] == ["gqa", "gqa", "none", "none", "gqa", "gqa"]
    rows = score(model, {"surgery": surgery, "distilled": distilled}, [TextSet("held", windows(9, 4), ())])
    unpruned, cut, fitted = rows
    assert unpruned.kl == 0 and unpruned.top1 == 1 and unpruned.acc is None
    assert 0 < fitted.kl < cut.kl
    assert "| distilled |" in format_report(rows)


def test_linear_replacement_and_end_to_end(model) -> None:
    linear = model.copy()
    fits = distill_local(model, linear, LAYERS, windows(0), ridge=0.1, linear=True)
    assert all(f.kind == "linear" and f.after < f.before for f in fits)
    assert linear.kinds[2].attention == "linear"
    assert linear.layers[2].self_attn.linear_attn.weight.abs().sum() > 0
    losses = end_to_end(model, linear, LAYERS, windows(0), steps=12, lr=1e-3, batch=4)
    assert len(losses) == 12 and np.mean(losses[-3:]) < losses[0]
    assert not any(p.requires_grad for p in linear.net.parameters())


def test_tradeoff_points(model, tmp_path) -> None:
    """prune_attention.py --tradeoff: one point per count, each the importance's choice, surgery and refit
    scored on the same held-out text against the same unpruned perplexity."""
    importance = attention_importance(model, windows(5, rows=2, seq=32), batch=2)
    held = [TextSet("held", windows(9, 4), ())]
    points = measure_tradeoff(model, importance, [1, 2], None, windows(0), held, ridge=0.1)
    assert [p.removed for p in points] == [1, 2] and len({p.unpruned for p in points}) == 1
    cheapest = min(importance, key=importance.get)
    assert points[0].layers == str(cheapest) and all(p.distilled != p.surgery for p in points)
    assert format_tradeoff(points).count("\n| ") == 4  # the header, its separator, one row per point
    plot_tradeoff(points, tmp_path / "t.png", "tiny")
    assert (tmp_path / "t.png").stat().st_size > 1000
