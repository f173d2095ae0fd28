"""Plan parsing and validation against the block table."""

from __future__ import annotations

import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.plan import Plan, parse_plan, validate_plan


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    spec = SyntheticSpec(blocks=[(True, 8), (False, 8), (False, 8), (True, 8), (False, 8)])
    return find_blocks(load_model(build_synthetic(spec, tmp_path_factory.mktemp("plan") / "m.onnx")))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([[0, 1]], "expected a JSON object"),
        ({"groups": [[0, 1]], "mode": "fold"}, "unknown key(s) 'mode'"),
        ({"groups": [[2, 1]]}, "reversed"),
        ({"groups": [[1, 1]]}, "single block"),
        ({"groups": [[1, "2"]]}, "two integers"),
        ({"groups": [[1, 2, 3]]}, "two integers"),
        ({"groups": [[0, 1]], "norm": "first"}, "unknown norm mode 'first'"),
        ({"groups": "0-1"}, "must be a list"),
    ],
)
def test_malformed_plans_are_refused(data, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_plan(data)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (((3, 5),), "out of range: the model has blocks 0..4"),
        (((0, 2), (2, 4)), "overlap"),
        (((1, 3),), "spans attention: block 3 has attention"),
        (((2, 1),), "first < last"),  # a Plan built in code, not parsed
        (((1, 1),), "first < last"),
    ],
)
def test_plans_that_do_not_fit_the_model_are_refused(blocks, groups, message):
    with pytest.raises(UserError, match=message):
        validate_plan(Plan(groups), blocks)


def test_group_may_start_at_a_block_with_attention(blocks):
    validate_plan(Plan(((0, 2), (3, 4)), "fold"), blocks)
    assert parse_plan({}).groups == () and parse_plan({}).norm == "last"
