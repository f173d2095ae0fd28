"""Plan proposal: limits, run boundaries, optimality; norm choice by measured error."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.analysis.propose import attention_free_runs, choose_norm, group_max_dependency, propose
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.plan import validate_plan
from passes.run import block_runner as runner

A, F = True, False


def _matrix(n: int, value: float = 0.05) -> np.ndarray:
    d = np.full((n, n), value)
    d[np.tril_indices(n)] = np.nan
    return d


def test_final_ffn_left_out_and_attention_never_spanned():
    attention = [A, F, F, F, F, A, F, F, A, F]  # runs 1-4, 6-7, 9
    proposal = propose(attention, [8] * 10, _matrix(10))
    assert [g.group for g in proposal.groups] == [(1, 3)]  # run 6-7 leaves only block 6; run 9 nothing
    assert "block 4 is the run's final FFN" in proposal.groups[0].stopped
    assert any("too short" in note for note in proposal.notes)


def test_threshold_splits_at_high_dependency():
    attention = [A] + [F] * 7 + [A]
    d = _matrix(9, 0.05)
    d[3, 4] = 0.5  # blocks 3 and 4 must not share a group
    proposal = propose(attention, [8] * 9, d, threshold=0.2)
    groups = [g.group for g in proposal.groups]
    assert groups in ([(1, 3), (4, 6)],)
    assert "D[3][4]" in proposal.groups[0].stopped
    assert all(g.max_dependency <= 0.2 for g in proposal.groups)


def test_max_group_and_max_width():
    attention = [A] + [F] * 9 + [A]
    widths = [16, 16, 16, 16, 64, 16, 16, 16, 16, 16, 16]
    by_size = propose(attention, widths, _matrix(11), max_group=3)
    assert all(j - i + 1 <= 3 for i, j in (g.group for g in by_size.groups))
    assert len(by_size.groups) == 3  # blocks 1-8 in 3 groups (9 is the run's final FFN)
    by_width = propose(attention, widths, _matrix(11), max_width=64)
    assert all(g.width <= 64 for g in by_width.groups)
    assert all(4 not in range(i, j + 1) for i, j in (g.group for g in by_width.groups))  # width 64 alone
    assert any("--max-width 64" in g.stopped for g in by_width.groups)
    with pytest.raises(UserError, match="at least 2"):
        propose(attention, widths, _matrix(11), max_group=1)


def test_start_at_attention_is_opt_in():
    attention = [A, A, F, F, F, A]
    d = _matrix(6)
    assert [g.group for g in propose(attention, [8] * 6, d).groups] == [(2, 3)]
    assert [g.group for g in propose(attention, [8] * 6, d, start_at_attention=True).groups] == [(1, 3)]


def _partitions(first: int, last: int):
    """All ways to cut first..last into contiguous segments."""
    cuts = range(first + 1, last + 1)
    for k in range(len(cuts) + 1):
        for chosen in itertools.combinations(cuts, k):
            bounds = [first, *chosen, last + 1]
            yield [(bounds[m], bounds[m + 1] - 1) for m in range(len(bounds) - 1)]


@settings(max_examples=60, deadline=None)
@given(
    attention=st.lists(st.booleans(), min_size=2, max_size=11),
    seed=st.integers(0, 2**16),
    threshold=st.floats(0.0, 1.0),
    max_group=st.one_of(st.none(), st.integers(2, 5)),
    max_width=st.one_of(st.none(), st.integers(8, 100)),
    at_attention=st.booleans(),
)
def test_proposal_invariants(attention, seed, threshold, max_group, max_width, at_attention):
    n = len(attention)
    rng = np.random.default_rng(seed)
    widths = [int(w) for w in rng.integers(4, 40, n)]
    d = rng.uniform(0, 1, (n, n))
    d[np.tril_indices(n)] = np.nan
    proposal = propose(attention, widths, d, threshold, max_group, max_width, at_attention)
    groups = [g.group for g in proposal.groups]
    assert groups == sorted(groups)
    run_ends = {b for _, b in attention_free_runs(attention)}
    for (i, j), choice in zip(groups, proposal.groups, strict=True):
        assert i < j
        assert not any(attention[i + 1 : j + 1]), "a group spans attention"
        assert at_attention or not attention[i]
        assert j not in run_ends and j + 1 < n and not attention[j + 1], "a run's final FFN is in a group"
        assert max_group is None or j - i + 1 <= max_group
        assert max_width is None or sum(widths[i : j + 1]) <= max_width
        assert choice.max_dependency <= threshold
        assert choice.max_dependency == group_max_dependency(d, i, j)
    for (_, j1), (i2, _) in itertools.pairwise(groups):
        assert j1 < i2
    # Fewest sequential steps: no partition of a run's fusable blocks that obeys the limits does better.
    for a, b in attention_free_runs(attention):
        first, last = (a - 1 if at_attention and a > 0 else a), b - 1
        if last <= first:
            continue
        ours = sum(1 for i, j in groups if first <= i and j <= last)
        ours_steps = (last - first + 1) - sum(j - i for i, j in groups if first <= i and j <= last)
        best = min(
            len(p)
            for p in _partitions(first, last)
            if all(
                j == i
                or (
                    (max_group is None or j - i + 1 <= max_group)
                    and (max_width is None or sum(widths[i : j + 1]) <= max_width)
                    and group_max_dependency(d, i, j) <= threshold
                )
                for i, j in p
            )
        )
        assert ours_steps == best, (ours, ours_steps, best)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    blocks = [(True, 48), (False, 64), (False, 40), (False, 56), (False, 32), (True, 32), (False, 48)]
    return build_synthetic(SyntheticSpec(blocks=blocks, seed=7), tmp_path_factory.mktemp("prop") / "m.onnx")


def test_proposal_passes_validate_plan(model):
    blocks = find_blocks(load_model(model))
    n = len(blocks)
    proposal = propose(
        [b.attention for b in blocks], [b.width for b in blocks], _matrix(n), start_at_attention=True
    )
    assert [g.group for g in proposal.groups] == [(0, 3)]
    validate_plan(proposal.plan("fold"), blocks)


def test_choose_norm_measures_both_modes(model, tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, (2, 10))
    choice = choose_norm(model, [(1, 3)], tokens, tmp_path)
    assert set(choice.errors) == {"last", "fold"}
    errors = {m: e["logits_rel_error"] for m, e in choice.errors.items()}
    assert choice.chosen == min(errors, key=errors.get)
    assert all(0 < e < 1 for e in errors.values())  # an approximation, not exact, not garbage
    assert errors["last"] != errors["fold"]
    assert list(tmp_path.iterdir()) == []  # the temporary fused models are gone
    assert choose_norm(model, [], tokens, tmp_path).chosen == "last"


def test_choose_norm_streams_large_models(model, tmp_path, monkeypatch):
    """Above STREAMING_BYTES the original and both fused models run block by block (models larger than
    RAM), with the same errors as whole-model sessions."""
    tokens = np.random.default_rng(0).integers(0, 64, (2, 10))
    whole = choose_norm(model, [(1, 3)], tokens, tmp_path)
    streamed_runs = []
    monkeypatch.setattr(runner, "STREAMING_BYTES", 0)
    tail = _recorded(runner.BlockRunner.run_tail, streamed_runs)
    monkeypatch.setattr(runner.BlockRunner, "run_tail", tail)
    streamed = choose_norm(model, [(1, 3)], tokens, tmp_path)
    assert len(streamed_runs) == 3  # the original and the two fused models
    for mode in ("last", "fold"):
        assert streamed.errors[mode]["logits_rel_error"] == pytest.approx(
            whole.errors[mode]["logits_rel_error"], rel=1e-4
        )
    assert streamed.chosen == whole.chosen


def _recorded(method, calls: list):
    def wrapper(self, *args):
        calls.append(self.path.name)
        return method(self, *args)

    return wrapper
