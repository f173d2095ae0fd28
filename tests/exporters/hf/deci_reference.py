"""An independent torch forward of a Nemotron-NAS (DeciLM) checkpoint folder, written from docs/design.md §7
and reading nothing but the folder: config.json (block_configs, rope) and the safetensors it lists.

Every SwiGLU's tensors must have the width the engines derive from `ffn_mult`
(ceil256(int(2 * ffn_mult * hidden / 3))), so a checkpoint whose config and tensors disagree fails here as
it would in vLLM or TensorRT-LLM. FP8 linear weights (ModelOpt's layout: float8_e4m3fn `weight` and
float32 `weight_scale`, [out, 1] or a scalar) are dequantized; activations stay float32.

The same forward for a GGUF file of llama.cpp's `deci` architecture (`gguf_logits`): it follows llama.cpp's
src/models/deci.cpp (per-layer head_count / head_count_kv / feed_forward_length; a layer without FFN is
skipped whole, as deci.cpp's `continue` skips it; rope on adjacent pairs of the permuted Q/K rows with the
`rope_freqs` factors, as ggml's normal rope mode) and reads the file with `read_gguf`, a reader written from
the GGUF format description alone (not the gguf package's), F32 / F16 / BF16 / Q8_0 tensors dequantized.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder (the shards the index lists, or model.safetensors), FP8 dequantized."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    raw: dict[str, torch.Tensor] = {}
    for name in files:
        raw.update(load_file(str(folder / name)))
    weights = {}
    for name, tensor in raw.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = raw[name.removesuffix("weight") + "weight_scale"].float()
            tensor = tensor.float() * (scale if scale.dim() else scale.reshape(()))
        weights[name] = tensor.float()
    return weights


def _width(ffn_mult: float, hidden: int) -> int:
    return math.ceil(int(2 * ffn_mult * hidden / 3) / 256) * 256


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _frequencies(config: dict, dim: int) -> torch.Tensor:
    """Rotary frequencies: theta^(-2i/d), with Llama 3.1's scaling when rope_scaling asks for it."""
    theta, rope = config["rope_theta"], config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    assert kind in ("default", "llama3"), kind
    out = []
    for i in range(0, dim, 2):
        f = theta ** (-i / dim)
        if kind == "llama3":
            wavelen, original = 2 * math.pi / f, rope["original_max_position_embeddings"]
            low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
            if wavelen > original / low:
                f = f / factor
            elif wavelen >= original / high:
                smooth = (original / wavelen - low) / (high - low)
                f = (1 - smooth) * f / factor + smooth * f
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[None, :, None].float(), angles.sin()[None, :, None].float()
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _attention(x: torch.Tensor, w: dict, p: str, heads: int, kv_heads: int, freqs) -> torch.Tensor:
    names = (f"{p}.{r}_proj.weight" for r in "qkvo")
    return _gqa(x, *(w[n] for n in names), heads, kv_heads, lambda t: _rotate(t, freqs))


def _gqa(x, wq, wk, wv, wo, heads: int, kv_heads: int, rope) -> torch.Tensor:
    """Causal GQA with weights [out, in]; `rope` rotates [batch, seq, heads, head_dim]."""
    b, s, _ = x.shape
    q = rope((x @ wq.T).view(b, s, heads, -1))
    k = rope((x @ wk.T).view(b, s, kv_heads, -1))
    v = (x @ wv.T).view(b, s, kv_heads, -1)
    k = k.repeat_interleave(heads // kv_heads, dim=2)  # query head h reads KV head h // group
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1) @ wo.T


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g = x @ gate.T
    return (g * torch.sigmoid(g) * (x @ up.T)) @ down.T


def deci_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """Logits [batch, seq, vocab] (float32) of the checkpoint in `folder` on token ids `ids`."""
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    assert config["num_hidden_layers"] == len(config["block_configs"])
    w = load_weights(folder)
    hidden, heads, eps = config["hidden_size"], config["num_attention_heads"], config["rms_norm_eps"]
    freqs = _frequencies(config, hidden // heads)
    with torch.no_grad():
        h = w["model.embed_tokens.weight"][torch.from_numpy(ids)]
        for i, block in enumerate(config["block_configs"]):
            p, attention, ffn = f"model.layers.{i}", block["attention"], block["ffn"]
            if not attention["no_op"]:
                x = _rms(h, w[f"{p}.input_layernorm.weight"], eps)
                if attention["replace_with_linear"]:
                    h = h + x @ w[f"{p}.self_attn.linear_attn.weight"].T
                else:
                    kv = heads // attention["n_heads_in_group"]
                    h = h + _attention(x, w, f"{p}.self_attn", heads, kv, freqs)
            if not ffn["no_op"]:
                x = _rms(h, w[f"{p}.post_attention_layernorm.weight"], eps)
                if ffn["replace_with_linear"]:
                    h = h + x @ w[f"{p}.mlp.linear_mlp.weight"].T
                else:
                    width = _width(ffn["ffn_mult"], hidden)
                    gate, up, down = (w[f"{p}.mlp.{r}_proj.weight"] for r in ("gate", "up", "down"))
                    assert gate.shape == up.shape == (width, hidden) and down.shape == (hidden, width), p
                    h = h + _swiglu(x, gate, up, down)
        tied = config.get("tie_word_embeddings")
        head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
        return (_rms(h, w["model.norm.weight"], eps) @ head.T).numpy()


# ----------------------------------------------------------------------------------------------- GGUF

# GGUF value types: struct formats of the scalar ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
F32, F16, Q8_0, BF16 = 0, 1, 8, 30  # ggml tensor types read here


class _Cursor:
    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        data, at, length, out = self.data, self.at, struct.Struct("<Q").unpack_from, []
        for _ in range(count):
            (size,) = length(data, at)
            out.append(data[at + 8 : at + 8 + size].decode("utf-8", "surrogateescape"))
            at += 8 + size
        self.at = at
        return out

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.take("I"), self.take("Q")
            if item in _NUMPY:
                array = np.frombuffer(self.data, _NUMPY[item], count, self.at)
                self.at += array.nbytes
                return array.tolist()
            if item == 8:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        return self.take(_SCALARS[kind])


def read_gguf(path: Path) -> tuple[dict, dict[str, tuple[int, tuple[int, ...], np.ndarray]]]:
    """(key/values, {tensor name: (ggml type, shape in numpy order, raw bytes as uint8)}) of a GGUF file
    (version 3, little-endian)."""
    with open(path, "rb") as file:
        header = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # slices are bytes: fast strings
    cursor = _Cursor(header)
    assert header[:4] == b"GGUF"
    cursor.at = 4
    version, n_tensors, n_kv = cursor.take("I"), cursor.take("Q"), cursor.take("Q")
    assert version == 3, version
    kv = {}
    for _ in range(n_kv):
        key = cursor.string()
        kv[key] = cursor.value(cursor.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.take("Q") for _ in range(cursor.take("I"))]
        infos.append((name, tuple(reversed(dims)), cursor.take("I"), cursor.take("Q")))
    align = kv.get("general.alignment", 32)
    start = -(-cursor.at // align) * align
    data = np.frombuffer(header, np.uint8)
    tensors = {}
    for name, shape, kind, offset in infos:
        assert offset % align == 0, name
        count = math.prod(shape)
        nbytes = {F32: 4 * count, F16: 2 * count, BF16: 2 * count, Q8_0: count // 32 * 34}[kind]
        assert start + offset + nbytes <= len(data), f"{name}: past the end of {path}"
        tensors[name] = (kind, shape, data[start + offset : start + offset + nbytes])
    return kv, tensors


def dequantize(kind: int, shape: tuple[int, ...], raw: np.ndarray) -> np.ndarray:
    """A tensor's values as float32, from its bytes: F32, F16, BF16 (the high half of a float32), Q8_0
    (blocks of 32: a float16 scale d, then 32 int8 q; value = d * q)."""
    if kind == F32:
        return raw.view(np.float32).reshape(shape)
    if kind == F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if kind == BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    assert kind == Q8_0, kind
    blocks = np.asarray(raw).reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (scale * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)


def _rope_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ggml's normal rope mode: pair (2i, 2i + 1) rotated by position x freqs[i]."""
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[None, :, None].float(), angles.sin()[None, :, None].float()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def gguf_logits(path: Path, ids: np.ndarray, read: tuple | None = None) -> np.ndarray:
    """Logits [batch, seq, vocab] (float32) of the GGUF file `path` (arch `deci`) on token ids `ids`, as
    llama.cpp's deci graph computes them (`read`: read_gguf's result, when the caller has it)."""
    kv, raw = read or read_gguf(path)
    assert kv["general.architecture"] == "deci"

    def key(name: str):
        return kv[f"deci.{name}"]

    w = {name: torch.from_numpy(dequantize(*t).copy()) for name, t in raw.items()}
    heads, kv_heads, ffns = (key(k) for k in ("attention.head_count", "attention.head_count_kv",
                                              "feed_forward_length"))
    n_layer, eps = key("block_count"), key("attention.layer_norm_rms_epsilon")
    head_dim, n_rot = key("attention.key_length"), key("rope.dimension_count")
    assert key("attention.value_length") == head_dim == n_rot and len(heads) == len(kv_heads) == n_layer
    assert heads[0] > 0  # llama.cpp takes the head size from layer 0
    base = key("rope.freq_base")
    freqs = torch.tensor([base ** (-2 * i / n_rot) for i in range(n_rot // 2)], dtype=torch.float64)
    if "rope_freqs.weight" in w:  # llama3: each pair's frequency divided by its factor
        freqs = freqs / w["rope_freqs.weight"].double()
    with torch.no_grad():
        h = w["token_embd.weight"][torch.from_numpy(ids)]
        for il in range(n_layer):
            p, n_head, n_kv, n_ff = f"blk.{il}", heads[il], kv_heads[il], ffns[il]
            residual = h
            cur = h if n_head == 0 else _rms(h, w[f"{p}.attn_norm.weight"], eps)
            if n_head > 0 and n_kv == 0:  # "linear attention"
                cur = cur @ w[f"{p}.attn_output.weight"].T
            elif n_head > 0:
                wq, wk, wv, wo = (w[f"{p}.attn_{r}.weight"] for r in ("q", "k", "v", "output"))
                assert wq.shape == (n_head * head_dim, h.shape[-1]) and wk.shape[0] == n_kv * head_dim
                cur = _gqa(cur, wq, wk, wv, wo, n_head, n_kv, lambda t: _rope_pairs(t, freqs))
            if n_ff == 0:  # deci.cpp: `continue`, the layer's output is dropped
                continue
            ffn_in = cur + residual if n_head > 0 else cur
            x = _rms(ffn_in, w[f"{p}.ffn_norm.weight"], eps)
            gate, up, down = (w[f"{p}.ffn_{r}.weight"] for r in ("gate", "up", "down"))
            assert gate.shape[0] == up.shape[0] == down.shape[1] == n_ff, p
            h = ffn_in + _swiglu(x, gate, up, down)
        head = w.get("output.weight", w["token_embd.weight"])
        return (_rms(h, w["output_norm.weight"], eps) @ head.T).numpy()
