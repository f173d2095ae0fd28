"""Rotary embedding frequencies of a Hugging Face checkpoint, in numpy float32, as transformers computes them.

    inv_freq, attention_factor = rope_parameters(config.rope, config.head_dim)

transformers computes these in torch float32; every step here is the same float32 operation in the same
order (a scalar divided by a tensor is torch's reciprocal-then-multiply), so the tables agree to the ulp
without importing torch. Used by the prefill and decode graphs (exporters.hf.prefill_graph's ModelGraph)
and by runtime.prune's torch model.
"""

from __future__ import annotations

import math

import numpy as np

from exporters.hf.config import RopeConfig

F32 = np.float32


def exponents(head_dim: int) -> np.ndarray:
    """arange(0, head_dim, 2) / head_dim in float32: inv_freq = 1 / theta ** exponents."""
    return np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)


def rope_parameters(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [head_dim / 2], attention factor) for every rope type.

    For dynamic NTK these are the unscaled frequencies; the graph rescales the base from the sequence length.
    """
    inv_freq = _rdiv(1.0, F32(rope.theta) ** exponents(head_dim))
    if rope.rope_type == "linear":
        return inv_freq / F32(rope.factor), 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    return inv_freq, 1.0


def _rdiv(scalar: float, tensor: np.ndarray) -> np.ndarray:
    """torch's `scalar / tensor`: tensor.reciprocal() * scalar, both roundings in float32."""
    return (F32(1.0) / tensor) * F32(scalar)


def _llama3(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    low_wavelen = F32(rope.original_max_positions / rope.low_freq_factor)
    high_wavelen = F32(rope.original_max_positions / rope.high_freq_factor)
    factor = F32(rope.factor)
    wavelen = _rdiv(2 * math.pi, inv_freq)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (_rdiv(rope.original_max_positions, wavelen) - F32(rope.low_freq_factor)) / F32(
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (F32(1.0) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
            if rope.mscale and rope.mscale_all_dim
            else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), F32(1))
    pos_freqs = F32(rope.theta) ** exponents(dim)
    extrapolation = F32(1.0) - ramp
    inv_freq = (
        _rdiv(1.0, F32(factor) * pos_freqs) * (F32(1.0) - extrapolation)
        + _rdiv(1.0, pos_freqs) * extrapolation
    )
    return inv_freq.astype(F32), float(attention_factor)
