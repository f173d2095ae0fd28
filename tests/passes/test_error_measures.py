"""The two relative errors (passes/error_measures.py) say what they compute, and differ where they should."""

from __future__ import annotations

import numpy as np
import pytest

from passes.error_measures import cosine, l2_relative_error, max_abs_relative_error


def test_l2_and_max_abs_against_hand_computed_values():
    reference = np.array([3.0, 4.0, 0.0])
    actual = np.array([3.0, 4.0, 1.0])
    assert l2_relative_error(actual, reference) == pytest.approx(1 / 5)  # ||(0,0,1)|| / ||(3,4,0)||
    assert max_abs_relative_error(actual, reference) == pytest.approx(1 / 4)  # max|d| / max|r|


def test_one_bad_element_counts_fully_in_max_abs_only():
    reference = np.ones(10_000, np.float32)
    actual = reference.copy()
    actual[7] = 2.0  # one wrong element (a wrong rank slice would show like this)
    assert max_abs_relative_error(actual, reference) == pytest.approx(1.0)
    assert l2_relative_error(actual, reference) == pytest.approx(0.01)


def test_float16_inputs_are_measured_in_float64_and_zero_reference_is_safe():
    a = np.array([1.0, 2.0], np.float16)
    assert l2_relative_error(a, a) == 0.0 and max_abs_relative_error(a, a) == 0.0
    assert max_abs_relative_error(np.ones(3), np.zeros(3)) == 1.0
    assert np.isfinite(l2_relative_error(np.ones(3), np.zeros(3)))
    assert cosine(np.array([1.0, 0.0]), np.array([0.0, 2.0])) == 0.0
