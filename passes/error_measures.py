"""How far one output is from a reference: the error measures every check in the project quotes."""

from __future__ import annotations

import numpy as np


def l2_relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    """||actual - reference||_2 / ||reference||_2, in float64 (fusion validation, FP8, heal)."""
    reference = np.asarray(reference, dtype=np.float64)
    diff = np.asarray(actual, dtype=np.float64) - reference
    return float(np.linalg.norm(diff) / max(np.linalg.norm(reference), 1e-30))


def max_abs_relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    """max |actual - reference| / max |reference| (tensor-parallel ranks against one device: the worst
    element, so a single wrong slice of a rank cannot hide in the average)."""
    reference = np.asarray(reference, dtype=np.float64)
    scale = float(np.max(np.abs(reference)))
    return float(np.max(np.abs(np.asarray(actual, dtype=np.float64) - reference))) / (scale if scale else 1.0)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of the two tensors flattened, in float64."""
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
