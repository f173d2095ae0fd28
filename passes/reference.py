"""An independent numpy evaluation of what a fused group must compute, from the original weights:

    y = x + sum_k W_down_k (silu(z_k W_gate_k) * (z_k W_up_k)),   z_k = x / rms(x) * w

with w the last block's norm weight ("last") or block k's own ("fold"). It reads the original weights of
one block at a time, a block of rows at a time, and never builds the concatenated matrices the rewrite
builds; int4 MatMulNBits weights are dequantized here, independently of ONNX Runtime. An FP8 graph's SwiGLU
FFN (passes/quant/fp8.py; its record passes/patterns/fp8.py) is evaluated the same way on FP8Weights: each
input through its QuantizeLinear -> DequantizeLinear, each float8 weight dequantized a row block at a time
(runtime/verify/fp8.py runs an FP8 graph's large blocks so).

A full-block parallel group (design §10) is referenced by `parallel_blocks_sum`: x + sum_k (block_k(x) - x)
in float64 from each ORIGINAL block run alone on the same x (passes/run/block_runner.py runs them), its
difference taken as the branches the block adds (no float32 cancellation of two streams).
"""

from __future__ import annotations

import numpy as np

from passes.blocks import Block
from passes.matching import strip_cast
from passes.patterns.fp8 import FP8SwiGLU, FP8Weight
from passes.patterns.swiglu import SwiGLU, Weight


def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(z: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(z @ gate) * (z @ up)) @ down


def group_ffns(blocks: list[Block], group: tuple[int, int]) -> list[Block]:
    """The original blocks whose FFNs a group [first, last] must sum, found from the block table itself
    (positions first..last, each checked to carry its own number) rather than through the rewrite's
    passes.fuse.ffn_members: a wrong member list in the rewrite cannot also be the reference's."""
    first, last = group
    members = blocks[first : last + 1]
    if [b.index for b in members] != list(range(first, last + 1)):
        raise ValueError(f"block table is not numbered 0..n-1 around group [{first}, {last}]")
    return [b for b in members if b.ffn is not None]


def norm_weight(block: Block) -> np.ndarray | None:
    weight = block.norm.weight
    return None if weight is None else strip_cast(weight).const_value.numpy().astype(np.float64)


def parallel_sum(x: np.ndarray, group: list[Block], mode: str) -> np.ndarray:
    """The parallel form of the group's FFNs applied to the stream `x`, in float64 (blocks without a
    SwiGLU FFN, FFN-free layers inside a group, add nothing)."""
    x = x.astype(np.float64)
    group = [b for b in group if b.ffn is not None]
    last = group[-1]
    out = x.copy()
    for block in group:
        norm_block = last if mode == "last" else block
        z = rms_normalize(x, norm_block.norm.eps)
        weight = norm_weight(norm_block)
        out += ffn(z if weight is None else z * weight, block.ffn)
    return out


def parallel_blocks_sum(x: np.ndarray, branches: list[list[np.ndarray]]) -> np.ndarray:
    """A full-block parallel group (design §10) in float64: x + sum_k (block_k(x) - x), with block_k(x) - x
    the residual branches (attention, FFN) each original block adds when run on the same input x."""
    return x.astype(np.float64) + sum(b.astype(np.float64) for block in branches for b in block)


def ffn_weight_bytes(block: Block) -> int:
    """Bytes of the block's FFN weights as stored (int4 scales and zero points included); 0 without one."""
    if block.ffn is None:
        return 0
    values = []
    for weight in (block.ffn.gate, block.ffn.up, block.ffn.down):
        values += [weight.source] + ([weight.nbits.scales, weight.nbits.zero_points] if weight.nbits else [])
    return sum(v.const_value.nbytes for v in values if v is not None)


def ffn(z: np.ndarray, swiglu_ffn: SwiGLU | FP8SwiGLU) -> np.ndarray:
    """down(silu(z @ gate) * (z @ up)) in float64, each weight read a block of rows at a time. Tokens go
    through in slices whose intermediate activations stay near ACTIVATION_BYTES (a fused group's width
    times many tokens would not), each slice reading the weights again."""
    tokens = z.reshape(-1, z.shape[-1])
    step = max(1, ACTIVATION_BYTES // (8 * swiglu_ffn.gate.shape[1]))
    parts = [_ffn(tokens[start : start + step], swiglu_ffn) for start in range(0, len(tokens), step)]
    return np.concatenate(parts).reshape(*z.shape[:-1], -1)


def _ffn(z: np.ndarray, swiglu_ffn: SwiGLU | FP8SwiGLU) -> np.ndarray:
    hidden = silu(matmul(z, swiglu_ffn.gate)) * matmul(z, swiglu_ffn.up)
    return matmul(hidden, swiglu_ffn.down)


# Weights are read a block of stored rows at a time (about this many bytes once in float64), and their
# memory map is released after each block: memory stays near one block whatever the matrix size.
ROW_BLOCK_BYTES = 32 << 20
# One float64 intermediate activation (tokens x FFN width) of ffn() stays near this many bytes.
ACTIVATION_BYTES = 32 << 20


def matmul(x: np.ndarray, weight: Weight | FP8Weight) -> np.ndarray:
    """x @ W (W the [in, out] matrix) in float64, reading W's stored rows a block at a time. An FP8Weight
    first quantizes x as its graph does (DQ(Q(x)))."""
    if isinstance(weight, FP8Weight):
        x = weight.quantized_input(x)
    rows, cols = weight.shape
    stored_rows, stored_cols = (cols, rows) if weight.transposed else (rows, cols)
    step = max(1, ROW_BLOCK_BYTES // (8 * stored_cols))
    out = np.zeros((*x.shape[:-1], cols))
    for start in range(0, stored_rows, step):
        stop = min(start + step, stored_rows)
        block = _stored_rows(weight, start, stop)
        if weight.transposed:  # stored [out, in]: these rows are columns start:stop of W
            out[..., start:stop] = x @ block.T
        else:
            out += x[..., start:stop] @ block
    return out


def _stored_rows(weight: Weight | FP8Weight, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of the weight as stored ([out, in] when transposed), float64."""
    if isinstance(weight, FP8Weight):
        return weight.dequantized_rows(start, stop)
    if weight.nbits is not None:
        return weight.dequantized(start, stop).T
    array = weight.source.const_value.numpy()
    columns = weight.columns
    if weight.transposed:
        first = columns[0] if columns is not None else 0
        block = array[first + start : first + stop].astype(np.float64)
    else:
        block = array[start:stop].astype(np.float64)
        block = block if columns is None else block[:, columns[0] : columns[1]]
    del array  # no view of the memory map may outlive it
    weight.release()
    return block
