"""An independent torch forward of a Nemotron-NAS (DeciLM) checkpoint folder, written from docs/design.md §7
and reading nothing but the folder: config.json (block_configs, rope) and the safetensors it lists.

Every SwiGLU's tensors must have the width the engines derive from `ffn_mult`
(ceil256(int(2 * ffn_mult * hidden / 3))), so a checkpoint whose config and tensors disagree fails here as
it would in vLLM or TensorRT-LLM. FP8 linear weights (ModelOpt's layout: float8_e4m3fn `weight` and
float32 `weight_scale`, [out, 1] or a scalar) are dequantized; activations stay float32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder (the shards the index lists, or model.safetensors), FP8 dequantized."""
    from safetensors.torch import load_file

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
    b, s, _ = x.shape
    q = _rotate((x @ w[f"{p}.q_proj.weight"].T).view(b, s, heads, -1), freqs)
    k = _rotate((x @ w[f"{p}.k_proj.weight"].T).view(b, s, kv_heads, -1), freqs)
    v = (x @ w[f"{p}.v_proj.weight"].T).view(b, s, kv_heads, -1)
    k = k.repeat_interleave(heads // kv_heads, dim=2)  # query head h reads KV head h // group
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1) @ w[f"{p}.o_proj.weight"].T


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
                    g = x @ gate.T
                    h = h + (g * torch.sigmoid(g) * (x @ up.T)) @ down.T
        tied = config.get("tie_word_embeddings")
        head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
        return (_rms(h, w["model.norm.weight"], eps) @ head.T).numpy()
