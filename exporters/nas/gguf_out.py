"""A Nemotron-NAS layout (exporters.nas.layout) as one GGUF file of llama.cpp's `deci` architecture, written
tensor by tensor, band by band: what llama.cpp's converter (convert_hf_to_gguf.py, conversion/deci.py)
writes for the same checkpoint, without the checkpoint (docs/deploy.md, "llama.cpp and Ollama").

Layers. llama.cpp reads per-layer `head_count`, `head_count_kv` and `feed_forward_length` arrays with the
converter's encoding: attention-free 0 / 0, a Linear attention heads / 0 (its weight is `attn_output`), GQA
heads / heads / n_heads_in_group; the FFN width is the width of the layer's own tensors (a fused group's
summed width: llama.cpp sizes the tensors from this array, any width loads). Where llama.cpp's deci graph
(src/models/deci.cpp) would not compute the checkpoint's model, the GGUF says the same thing another way,
exactly:
- a layer with attention and no FFN: deci.cpp skips the rest of such a layer (`if (n_ff == 0) continue;`)
  before adding the attention output to the stream, so the attention would be lost; it gets a zero FFN
  (ZERO_FFN_WIDTH wide, down projection all zeros: it adds exactly 0);
- a Linear FFN (replace_with_linear), which deci.cpp has no form for: the layer's attention part (if any)
  is one GGUF layer with a zero FFN, and the Linear FFN a second GGUF layer that is a "linear attention"
  (norm, then one hidden x hidden matrix, added to the stream) with a zero FFN;
- an identity layer (no attention, no FFN) is left out (it computes nothing; as the last layer, deci.cpp
  would also skip selecting the output rows).
A model whose first layer has no attention cannot be written: llama.cpp takes the head size of every layer
from layer 0's head count.

Tensors. Names as the converter maps them (token_embd, blk.N.attn_q, ..., output_norm, output; no
`output` when the embeddings are tied: llama.cpp then reads token_embd); Q and K rows permuted as the
converter's `DeciModel.permute` (llama.cpp's rope rotates adjacent pairs, the checkpoint's halves); a llama3
rope writes the `rope_freqs` factors. Norms and 1-D tensors stay float32; the rest is f32, f16, bf16 or q8_0
(Q8_0 blocks of 32 along a row; a row not a multiple of 32 falls back to f16, as the converter does).

Streaming. The header (key/values and tensor infos) is written by the gguf package's GGUFWriter; then each
tensor at its aligned offset: a kernel copy from the ONNX data file where its bytes are already there, else
bands of about 16 MB of float32 rows read, permuted, converted and written (a band written by a second
thread while the next is converted). Q8_0 is quantized band by band (rows are independent, so this equals
quantizing the whole tensor: `gguf.quants.quantize`, bit for bit), by exporters/nas/_q8_0.c where it is
built, else by numpy.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from exporters.nas.layout import NasLayout, TensorSource
from exporters.nas.safetensors_out import _runs, _Sources, _write_run, band_rows, range_copy
from passes.errors import UserError
from passes.io.file_copy import write_at

ARCH = "deci"
QTYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
GGUF_DTYPES = tuple(QTYPES)
# The width of the zero FFN that keeps an FFN-less layer's attention (a multiple of 256: llama-quantize's
# k-quants take it as it is).
ZERO_FFN_WIDTH = 256
_Q8_BLOCK, _Q8_BYTES = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0]
_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclass(frozen=True)
class GgufSource:
    """One GGUF tensor: its name and its values (rows of a layout tensor, or a constant)."""

    name: str
    source: TensorSource
    permute_heads: int = 0  # Q/K: rows permuted as DeciModel.permute with this many heads
    values: np.ndarray | None = None  # a computed 1-D tensor (rope_freqs)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape if self.values is None else tuple(self.values.shape)


@dataclass
class GgufLayer:
    """One layer of the GGUF file (blk.N): the source layers it computes and its hyperparameters."""

    source_layers: list[int]
    heads: int
    kv_heads: int
    ffn: int
    tensors: list[GgufSource] = field(default_factory=list)
    note: str = ""  # why this layer differs from the converter's, if it does


@dataclass
class GgufPlan:
    layers: list[GgufLayer]
    tensors: list[GgufSource]  # in file order
    rope_freqs: np.ndarray | None


def plan_gguf(layout: NasLayout) -> GgufPlan:
    """The GGUF layers and tensors of `layout` (see the module docstring); UserError when llama.cpp's deci
    architecture cannot compute the model."""
    source = layout.source
    if source.rope.rope_type not in ("default", "llama3"):
        raise UserError(
            f"{source.path}: rope type {source.rope.rope_type!r} has no llama.cpp deci form here (default "
            "and llama3 only)"
        )
    if source.head_dim * source.heads != source.hidden:
        raise UserError(
            f"{source.path}: head_dim {source.head_dim} x {source.heads} heads is not hidden_size "
            f"{source.hidden}: llama.cpp's deci layers need hidden_size / heads"
        )
    layers: list[GgufLayer] = []
    for out in layout.layers:
        layers += _gguf_layers(out.source_layers, {_part(t.name): t for t in out.tensors}, source)
    if not layers or layers[0].heads == 0:
        first = layers[0].source_layers if layers else []
        raise UserError(
            f"{source.path}: layer {first[0] if first else 0} has no attention; llama.cpp's deci takes every "
            "layer's head size from layer 0's head count, so a model whose first layer has no attention "
            "does not load"
        )
    for index, layer in enumerate(layers):
        layer.tensors = [
            GgufSource(f"blk.{index}.{t.name}", t.source, t.permute_heads) for t in layer.tensors
        ]
    head = {t.name: t for t in layout.tensors if not t.name.startswith("model.layers.")}
    tensors = [GgufSource("token_embd.weight", head["model.embed_tokens.weight"])]
    rope_freqs = _rope_freqs(source) if source.rope.rope_type == "llama3" else None
    if rope_freqs is not None:
        placeholder = TensorSource("rope_freqs.weight", tuple(rope_freqs.shape))
        tensors.append(GgufSource("rope_freqs.weight", placeholder, values=rope_freqs))
    tensors += [t for layer in layers for t in layer.tensors]
    tensors.append(GgufSource("output_norm.weight", head["model.norm.weight"]))
    if "lm_head.weight" in head:  # tied: no output.weight, llama.cpp uses token_embd (TENSOR_DUPLICATED)
        tensors.append(GgufSource("output.weight", head["lm_head.weight"]))
    return GgufPlan(layers, tensors, rope_freqs)


def _part(name: str) -> str:
    """model.layers.N.self_attn.q_proj.weight -> self_attn.q_proj.weight"""
    return name.split(".", 3)[3]


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.linear_attn.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_layers(source_layers: list[int], parts: dict[str, TensorSource], source) -> list[GgufLayer]:
    """One output layer of the layout as 0, 1 or 2 GGUF layers (tensor names still without blk.N.)."""
    hidden, heads = source.hidden, source.heads

    def named(*keys: str, permute: dict | None = None) -> list[GgufSource]:
        return [GgufSource(_NAMES[k], parts[k], (permute or {}).get(k, 0)) for k in keys if k in parts]

    attention: GgufLayer | None = None
    if "self_attn.q_proj.weight" in parts:
        kv = parts["self_attn.k_proj.weight"].shape[0] // source.head_dim
        permute = {"self_attn.q_proj.weight": heads, "self_attn.k_proj.weight": kv}
        keys = ("input_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"))
        attention = GgufLayer(source_layers, heads, kv, 0, named(*keys, permute=permute))
    elif "self_attn.linear_attn.weight" in parts:
        keys = ("input_layernorm.weight", "self_attn.linear_attn.weight")
        attention = GgufLayer(source_layers, heads, 0, 0, named(*keys))
    if "mlp.gate_proj.weight" in parts:
        ffn = named(*(k for k in _NAMES if k.startswith(("post_attention", "mlp."))))
        width = parts["mlp.gate_proj.weight"].shape[0]
        if attention is None:
            return [GgufLayer(source_layers, 0, 0, width, ffn)]
        attention.ffn, attention.tensors = width, attention.tensors + ffn
        return [attention]
    layers = []
    if attention is not None:  # no FFN, or a Linear FFN (below): keep the attention output
        attention.ffn = ZERO_FFN_WIDTH
        attention.tensors += _zero_ffn(hidden)
        attention.note = "zero FFN: llama.cpp's deci skips the residual add of a layer without FFN"
        layers.append(attention)
    if "mlp.linear_mlp.weight" in parts:  # a Linear FFN as a "linear attention" layer with a zero FFN
        tensors = [
            GgufSource("attn_norm.weight", parts["post_attention_layernorm.weight"]),
            GgufSource("attn_output.weight", parts["mlp.linear_mlp.weight"]),
            *_zero_ffn(hidden),
        ]
        note = "the Linear FFN as a linear attention with a zero FFN (llama.cpp's deci has no Linear FFN)"
        layers.append(GgufLayer(source_layers, heads, 0, ZERO_FFN_WIDTH, tensors, note))
    return layers  # empty for an identity layer


def _zero_ffn(hidden: int) -> list[GgufSource]:
    width = ZERO_FFN_WIDTH
    return [
        GgufSource("ffn_norm.weight", TensorSource("ones", (hidden,), fill=1.0)),
        GgufSource("ffn_gate.weight", TensorSource("zeros", (width, hidden), fill=0.0)),
        GgufSource("ffn_up.weight", TensorSource("zeros", (width, hidden), fill=0.0)),
        GgufSource("ffn_down.weight", TensorSource("zeros", (hidden, width), fill=0.0)),
    ]


def _rope_freqs(source) -> np.ndarray:
    """The converter's llama3 `rope_freqs` (DeciModel.generate_extra_tensors), in float32 as torch computes
    it: a factor per rotary pair by which llama.cpp divides that pair's frequency."""
    rope, dim = source.rope, source.head_dim
    base = np.float32(rope.theta)
    freqs = np.float32(1.0) / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old = rope.original_max_positions
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
            factors.append(float(np.float32(1) / ((np.float32(1) - smooth) / np.float32(factor) + smooth)))
    return np.array(factors, dtype=np.float32)


# ------------------------------------------------------------------------------------------- metadata


class Writer(gguf.GGUFWriter):
    """gguf's GGUFWriter, packing long arrays (a tokenizer's tokens, merges, types and scores) in one go:
    the bytes GGUFWriter's own item-by-item packing gives (about 3 s for Llama 3's 128256 tokens and 280147
    merges), in a tenth of the time."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None) -> bytes:
        fast = vtype == gguf.GGUFValueType.ARRAY and sub_type is None and isinstance(val, list) and val
        if not fast or self.endianess != gguf.GGUFEndian.LITTLE:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        if all(isinstance(v, str | bytes) for v in val):
            length = struct.Struct("<Q").pack
            encoded = (v.encode("utf-8") if isinstance(v, str) else v for v in val)
            body = b"".join(length(len(b)) + b for b in encoded)
            item = gguf.GGUFValueType.STRING
        elif all(type(v) is float for v in val):
            body, item = np.array(val, dtype="<f4").tobytes(), gguf.GGUFValueType.FLOAT32
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in val):
            body, item = np.array(val, dtype="<i4").tobytes(), gguf.GGUFValueType.INT32
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        return head + struct.pack("<IQ", item, len(val)) + body



def add_metadata(writer: gguf.GGUFWriter, layout: NasLayout, plan: GgufPlan, dtype: str, name: str) -> None:
    """What the converter writes for a Nemotron-NAS checkpoint with block_configs (DeciModel and TextModel),
    the tokenizer aside (exporters.nas.gguf_vocab)."""
    source = layout.source
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    params = sum(math.prod(t.shape) for t in plan.tensors)
    writer.add_size_label(gguf.size_label(params, params, 0, 0))
    writer.add_rope_freq_base(source.rope.theta)
    writer.add_head_count_kv([layer.kv_heads for layer in plan.layers])
    writer.add_head_count([layer.heads for layer in plan.layers])
    writer.add_feed_forward_length([layer.ffn for layer in plan.layers])
    writer.add_block_count(len(plan.layers))
    writer.add_context_length(int(source.raw.get("max_position_embeddings") or source.rope.max_positions))
    writer.add_embedding_length(source.hidden)
    writer.add_layer_norm_rms_eps(source.eps)
    writer.add_key_length(source.head_dim)
    writer.add_value_length(source.head_dim)
    writer.add_file_type(FILE_TYPES[dtype])
    writer.add_vocab_size(source.vocab)
    writer.add_rope_dimension_count(source.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# -------------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its type, byte count and writer (the interface of safetensors_out's
    OutTensor that its `_runs` and `_write_run` use)."""

    name: str
    shape: tuple[int, ...]  # numpy order: [rows, cols]
    qtype: gguf.GGMLQuantizationType
    nbytes: int
    write: Callable[[int, int], int]
    origin: tuple | None = None


def tensor_type(spec: GgufSource, dtype: str) -> gguf.GGMLQuantizationType:
    """The converter's choice: norms and 1-D tensors float32; Q8_0 rows that are no multiple of 32: F16."""
    if len(spec.shape) <= 1 or spec.name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    if dtype == "q8_0" and spec.shape[-1] % _Q8_BLOCK:
        return gguf.GGMLQuantizationType.F16
    return QTYPES[dtype]


def byte_count(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def gguf_tensor(spec: GgufSource, dtype: str) -> GgufTensor:
    """The writer of one tensor: a kernel copy from the ONNX data file when its bytes are there in the
    output type, else bands of rows read, permuted and converted."""
    qtype = tensor_type(spec, dtype)
    shape, source = spec.shape, spec.source
    nbytes = byte_count(shape, qtype)
    if spec.values is not None:
        data = spec.values.astype(np.float32).tobytes()
        return GgufTensor(spec.name, shape, qtype, nbytes, lambda fd, at: _write_bytes(fd, data, at))
    stored = np.dtype(source.tensor.dtype.numpy()) if source.tensor is not None else None
    plain = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
             gguf.GGMLQuantizationType.BF16: ml_dtypes.bfloat16}.get(qtype)
    if source.kernel_copyable and not spec.permute_heads and plain is not None and stored == np.dtype(plain):
        path, start, length = source.byte_range()
        path = os.path.realpath(path)
        return GgufTensor(spec.name, shape, qtype, nbytes, range_copy(path, start, length),
                          ("copy", path, start, length))
    return GgufTensor(spec.name, shape, qtype, nbytes, lambda fd, at: _write_bands(spec, qtype, fd, at))


def _write_bytes(fd: int, data: bytes, at: int) -> int:
    write_at(fd, data, at)
    return len(data)


def _write_bands(spec: GgufSource, qtype: gguf.GGMLQuantizationType, fd: int, at: int) -> int:
    source = spec.source
    rows, cols = source.height, source.shape[-1]
    step = band_rows(cols)
    head_rows = rows // spec.permute_heads if spec.permute_heads else 1
    step = max(1, step // head_rows) * head_rows  # whole heads per band
    written, pending = 0, None
    # A band is written by a second thread while the next one is read and converted (both release the
    # interpreter lock): at most two bands in memory.
    with ThreadPoolExecutor(1, thread_name_prefix="gguf-write") as writer:
        for first in range(0, rows, step):
            band = source.read(first, min(first + step, rows))
            if spec.permute_heads:
                band = permute_rows(band, len(band) // head_rows)
            data = encode(band, qtype)
            if pending is not None:
                pending.result()
            pending = writer.submit(write_at, fd, data.view(np.uint8).reshape(-1), at + written)
            written += data.nbytes
        if pending is not None:
            pending.result()
    return written


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """The converter's DeciModel.permute of a Q or K weight ([heads * head_dim, in]): within each head, the
    rows of the two rotary halves interleaved (llama.cpp's rope rotates adjacent pairs)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


def encode(rows: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Rows in the file's type: float32 / float16 / bfloat16 (round to nearest even, as ggml and the
    converter) or Q8_0 blocks."""
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        return quantize_q8_0(rows)
    target = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
              gguf.GGMLQuantizationType.BF16: ml_dtypes.bfloat16}[qtype]
    if rows.dtype == np.dtype(target):
        return np.ascontiguousarray(rows)
    return np.ascontiguousarray(rows.astype(np.float32, copy=False).astype(target, copy=False))


_HALF_DOWN = np.nextafter(np.float32(0.5), np.float32(0))  # the largest float32 below 0.5

try:  # Q8_0 in one pass (exporters/nas/_q8_0.c); where it is not built, numpy gives the same bytes
    from exporters.nas import _q8_0
except ImportError:
    _q8_0 = None


def quantize_q8_0(rows: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of `rows` [n, cols] (float32 or bfloat16), the bytes `gguf.quants.quantize(rows, Q8_0)`
    gives (ggml's reference quantize_row_q8_0): per 32 values, d = max|x| / 127 (stored float16) and
    round(x / d) as int8, rounding half away from zero. By exporters/nas/_q8_0.c where it is built, else
    by numpy (quantize_q8_0_numpy)."""
    if _q8_0 is None:
        return quantize_q8_0_numpy(rows)
    count, cols = rows.shape
    bfloat16 = rows.dtype == np.dtype(ml_dtypes.bfloat16)
    source = np.ascontiguousarray(rows if bfloat16 else rows.astype(np.float32, copy=False))
    blocks = np.empty((source.size // _Q8_BLOCK, _Q8_BYTES), np.uint8)
    scales = np.empty(len(blocks), np.float32)
    _q8_0.quantize(source.ctypes.data, source.size, blocks.ctypes.data, scales.ctypes.data, bfloat16)
    blocks[:, :2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(count, cols // _Q8_BLOCK * _Q8_BYTES)


def quantize_q8_0_numpy(rows: np.ndarray) -> np.ndarray:
    """quantize_q8_0 in numpy. The rounding half away from zero is done as truncation of x / d +
    copysign(0.49999997, x / d), which is exact for every float32 of magnitude up to 128 (checked over all
    of them), in fewer passes than gguf's floor-based `np_roundf`."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    count, cols = rows.shape
    blocks = rows.reshape(-1, _Q8_BLOCK)
    amax = np.abs(blocks)
    while amax.shape[1] > 1:  # max over each block by halves: twice as fast as .max(axis=1) on rows of 32
        half = amax.shape[1] // 2
        amax = np.maximum(amax[:, :half], amax[:, half:])
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
    scaled = blocks * inverse
    scaled += np.copysign(_HALF_DOWN, scaled)
    out = np.empty((len(blocks), _Q8_BYTES), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = scaled.astype(np.int8).view(np.uint8)
    return out.reshape(count, cols // _Q8_BLOCK * _Q8_BYTES)


# ------------------------------------------------------------------------------------------------ file


def write_gguf(
    path: Path, writer: gguf.GGUFWriter, tensors: list[GgufTensor],
    log: Callable[[str], None] = lambda message: None,
) -> int:
    """Write the header of `writer` (its key/values) with the infos of `tensors`, then every tensor at its
    aligned offset; returns the file's size."""
    for tensor in tensors:
        writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                               raw_dtype=tensor.qtype)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.flush()
    align = writer.data_alignment
    start = gguf.GGUFWriter.ggml_pad(writer.fout[0].tell(), align)
    writer.close()
    offsets, at = [], start
    for tensor in tensors:
        offsets.append(at)
        at += gguf.GGUFWriter.ggml_pad(tensor.nbytes, align)
    fd = os.open(path, os.O_WRONLY)
    sources = _Sources()
    try:
        for run in _runs(tensors, offsets):
            _write_run(run, fd, sources, None)
        os.ftruncate(fd, at)
    finally:
        sources.close()
        os.close(fd)
    log(f"  {len(tensors)} tensors, {at / 2**20:.1f} MiB")
    return at
