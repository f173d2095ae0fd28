"""The greedy walk, the frontier and the budget's choice, on made-up costs and speedups (no model)."""

from __future__ import annotations

import pytest

from passes.errors import UserError
from passes.plan import Plan
from runtime.frontier.measure import Quality
from runtime.frontier.moves import Move, dominated, plan_of, walk
from runtime.frontier.report import Entry, FrontierReport


def speedup_by_steps(plan: Plan) -> float:
    """Each block a group removes from the sequence saves 1%."""
    removed = sum(j - i for i, j in plan.groups) + sum(j - i for i, j in plan.parallel)
    return 1 / (1 - 0.01 * removed)


def test_walk_takes_the_cheapest_speedup_first_and_grows_groups():
    moves = [Move("ffn", (i, j), "last") for i in range(10, 14) for j in range(i + 1, 14)]
    moves += [Move("parallel", (0, 3))]
    costs = {m: 0.01 * (m.group[1] - m.group[0]) for m in moves}
    costs[Move("ffn", (12, 13), "last")] = 0.001  # the cheapest pair
    costs[Move("parallel", (0, 3))] = 1.0  # expensive: last
    steps = walk(moves, "last", lambda m: costs[m], speedup_by_steps)
    assert steps[0].plan == Plan(((12, 13),), "last")
    assert steps[-1].plan.parallel == ((0, 3),)
    # A grown group swallows the groups it contains; no plan holds overlapping groups.
    for step in steps:
        groups = sorted(step.plan.groups + step.plan.parallel)
        assert all(a[1] < b[0] for a, b in zip(groups, groups[1:], strict=False))
    assert any(g == (10, 13) for g in steps[-1].plan.groups)
    # The summed cost is the sum of the final moves' own costs.
    assert steps[-1].summed_cost == pytest.approx(sum(costs[m] for m in steps[-1].moves))
    speeds = [s.predicted_speedup for s in steps]
    assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds)


def test_walk_keeps_its_norm_mode():
    moves = [Move("ffn", (1, 2), "last"), Move("ffn", (1, 2), "fold")]
    steps = walk(moves, "fold", lambda m: 0.1, speedup_by_steps)
    assert [s.plan for s in steps] == [Plan(((1, 2),), "fold")]
    assert plan_of((), "fold").norm == "last"  # a plan without FFN groups has one spelling


def test_dominated():
    points = [(1.0, 0.0), (1.1, 0.2), (1.05, 0.3), (1.2, 0.5), (1.2, 0.6)]
    assert dominated(points) == [False, False, True, False, True]


def entry(label: str, speed: float, kl: float, groups=((1, 2),)) -> Entry:
    return Entry(label, Plan(groups), speed, kl, kl, Quality(kl, 10.0, 9.0, 0.9, 100, 0.0), 10, 5)


def report(**budget) -> FrontierReport:
    entries = [entry("original", 1.0, 0.0, ())]
    entries += [entry("a", 1.1, 0.05), entry("b", 1.2, 0.2), entry("c", 1.3, 0.9)]
    flags = dominated([(e.predicted_speedup, e.quality.kl) for e in entries])
    marked = [e.with_frontier(not d) for e, d in zip(entries, flags, strict=True)]
    return FrontierReport("m.onnx", "t", "c", {}, marked, **budget)


def test_choose_for_a_budget():
    assert report(max_kl=0.3).choose().label == "b"
    assert report(max_kl=0.05).choose().label == "a"
    assert report(min_speedup=1.15).choose().label == "b"
    assert report().choose() is None


def test_a_budget_no_plan_meets_names_the_best_achievable():
    with pytest.raises(UserError, match=r"smallest KL .* is 0.05 \(a "):
        report(max_kl=0.01).choose()
    with pytest.raises(UserError, match=r"fastest measured plan predicts 1.3x \(c "):
        report(min_speedup=2.0).choose()


def test_a_budgets_walk_keeps_the_summed_cost_within_it():
    """The ratio walk may take a large move first; the budget's walk finds the plans below it."""
    moves = [Move("parallel", (0, 3)), Move("ffn", (10, 11), "last"), Move("ffn", (12, 13), "last")]
    costs = {moves[0]: 0.05, moves[1]: 0.04, moves[2]: 0.05}
    free = walk(moves, "last", costs.__getitem__, speedup_by_steps)
    assert free[0].plan.parallel == ((0, 3),)  # 3 steps for 0.05: the best ratio
    within = walk(moves, "last", costs.__getitem__, speedup_by_steps, max_cost=0.045)
    assert [s.plan for s in within] == [Plan(((10, 11),), "last")]
    assert all(s.summed_cost <= 0.045 for s in within)


def test_the_cheapest_walk_fills_the_low_kl_end():
    moves = [Move("parallel", (0, 3)), Move("ffn", (10, 11), "last"), Move("ffn", (12, 13), "last")]
    costs = {moves[0]: 0.05, moves[1]: 0.03, moves[2]: 0.025}  # per step saved: 0.017, 0.03, 0.025
    first = walk(moves, "last", costs.__getitem__, speedup_by_steps)[0]
    assert first.plan == Plan((), "last", ((0, 3),))
    low = walk(moves, "last", costs.__getitem__, speedup_by_steps, first.summed_cost * 0.999, cheapest=True)
    assert [s.plan for s in low] == [Plan(((12, 13),), "last")]  # + [10, 11] would cost 0.055


def test_a_speedup_floors_walk_stops_at_the_floor_by_the_cheapest_moves():
    """--min-speedup: cheapest-first until the floor. The ratio walk reaches 1.015 with the parallel group
    (cost 0.05); the floor's walk takes the cheaper pair first, then the other (0.055 in all)."""
    moves = [Move("parallel", (0, 3)), Move("ffn", (10, 11), "last"), Move("ffn", (12, 13), "last")]
    costs = {moves[0]: 0.05, moves[1]: 0.03, moves[2]: 0.025}
    floor = walk(moves, "last", costs.__getitem__, speedup_by_steps, cheapest=True, until=1.015)
    assert [s.plan for s in floor] == [Plan(((12, 13),), "last"), Plan(((10, 11), (12, 13)), "last")]
    assert floor[-1].predicted_speedup >= 1.015 > floor[-2].predicted_speedup  # the first to reach it
