"""An independent numpy evaluation of what a fused group must compute, from the original weights:

    y = x + sum_k W_down_k (silu(z_k W_gate_k) * (z_k W_up_k)),   z_k = x / rms(x) * w

with w the last block's norm weight ("last") or block k's own ("fold"). It reads the weights of one
block at a time and never builds the concatenated matrices the rewrite builds.
"""

from __future__ import annotations

import numpy as np

from passes.blocks import Block
from passes.graph import strip_cast


def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(z: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(z @ gate) * (z @ up)) @ down


def norm_weight(block: Block) -> np.ndarray | None:
    weight = block.norm.weight
    return None if weight is None else strip_cast(weight).const_value.numpy().astype(np.float64)


def parallel_sum(x: np.ndarray, group: list[Block], mode: str) -> np.ndarray:
    """The parallel form of the group's FFNs applied to the stream `x`, in float64."""
    x = x.astype(np.float64)
    last = group[-1]
    out = x.copy()
    for block in group:
        norm_block = last if mode == "last" else block
        z = rms_normalize(x, norm_block.norm.eps)
        weight = norm_weight(norm_block)
        z = z if weight is None else z * weight
        mats = [w.matrix().astype(np.float64) for w in (block.ffn.gate, block.ffn.up, block.ffn.down)]
        out += swiglu(z, *mats)
        del mats
        for w in (block.ffn.gate, block.ffn.up, block.ffn.down):
            w.release()
    return out
