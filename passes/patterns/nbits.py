"""com.microsoft MatMulNBits weights (ONNX Runtime GenAI's int4): the packing of their fields, and their
dequantized matrix. The one place that knows the layout: the fusion concatenates packed rows with
`unpack`/`pack`; the reference and `Weight.matrix` read the float matrix through `NBits.dequantize`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes -> their `bits`-wide fields as uint8, the low bits first (last axis grows 8 / bits
    times)."""
    fields = (packed[..., None] >> np.arange(0, 8, bits, dtype=np.uint8)) & np.uint8((1 << bits) - 1)
    return fields.reshape(*packed.shape[:-1], -1)


def pack(fields: np.ndarray, bits: int) -> np.ndarray:
    """[rows, fields] values below 2^bits -> [rows, bytes] uint8, the low bits first (unpack's inverse)."""
    per_byte = 8 // bits
    padded = np.zeros((fields.shape[0], -(-fields.shape[1] // per_byte) * per_byte), np.uint8)
    padded[:, : fields.shape[1]] = fields
    grouped = padded.reshape(fields.shape[0], -1, per_byte) << np.arange(0, 8, bits, dtype=np.uint8)
    return np.bitwise_or.reduce(grouped, axis=2).astype(np.uint8)


@dataclass(frozen=True)
class NBits:
    """A com.microsoft MatMulNBits weight: W[n, k] = (q - zero_point) * scale per block of `block_size` k's.

    `source` (the Weight's) holds q packed as uint8 [N, blocks, block_size * bits / 8], low bits first;
    scales are [N * blocks] (or [N, blocks]); zero points are packed uint8 [N * ceil(blocks * bits / 8)]
    or of the scales' type [N * blocks]; absent, they are 2^(bits - 1)."""

    node: ir.Node  # the MatMulNBits node (its other attributes are kept when fused)
    scales: ir.Value
    zero_points: ir.Value | None
    k: int
    n: int
    bits: int
    block_size: int

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block_size)

    def dequantize(self, packed: np.ndarray, rows: slice) -> np.ndarray:
        """Output rows `rows` (N) of the weight as the [in, out] float64 matrix's columns, from the packed
        values (`source`'s array): (q - zero_point) * scale per block, low bits first. Only those rows are
        read."""
        values = unpack(packed[rows], self.bits).astype(np.float64).reshape(-1, self.blocks, self.block_size)
        scales = self.scales.const_value.numpy().reshape(self.n, self.blocks)[rows].astype(np.float64)
        if self.zero_points is None:
            zero_points = np.full(scales.shape, 2.0 ** (self.bits - 1))
        else:
            stored = self.zero_points.const_value.numpy().reshape(self.n, -1)[rows]
            is_packed = stored.dtype == np.uint8
            zero_points = (unpack(stored, self.bits)[:, : self.blocks] if is_packed else
            stored).astype(np.float64)
            del stored  # no view of the memory map may outlive it
        matrix = (values - zero_points[..., None]) * scales[..., None]
        return matrix.reshape(len(values), -1)[:, : self.k].T


def float_activations(proto: onnx.ModelProto) -> int:
    """Set every MatMulNBits of `proto` to accuracy_level 0 (float activations), in place; returns how many
    changed. GenAI's int4 uses level 4: activations quantized to int8 per block, so a 1e-7 difference in a
    MatMul's input (two graph cuts that ONNX Runtime optimizes differently) can flip a rounding step and move
    the output by ~1e-2. Checks of a rewrite's exactness compare both sides at level 0."""
    changed = 0
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        for attribute in node.attribute:
            if attribute.name == "accuracy_level" and attribute.i != 0:
                attribute.i = 0
                changed += 1
    return changed
