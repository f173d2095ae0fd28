"""A torch model of a Hugging Face Llama-family or Nemotron-NAS (DeciLM) checkpoint, with its parameter names.

Built from an `exporters.hf_config.HfConfig`, usually on the meta device: the ONNX export needs only the
parameters' names, shapes and dtypes, and the weights are streamed into the ONNX file afterwards
(exporters.hf_checkpoint). Parameter names are the checkpoint's (model.layers.N.self_attn.q_proj.weight,
...self_attn.linear_attn.weight, ...mlp.linear_mlp.weight, lm_head.weight), so an initializer of the
exported graph names the safetensors tensor that fills it.

The blocks reuse exporters.llama's RMSNorm, MLP and Attention (explicit MatMul/Softmax attention with GQA
broadcast). Rotary embeddings follow transformers' rope types: default, linear, llama3 and yarn are fixed
inverse frequencies (a buffer, float32) and an attention factor on cos/sin; dynamic NTK computes its
base inside the graph from the sequence length, as a fresh transformers model does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from exporters.hf_config import HfConfig, LayerConfig, RopeConfig
from exporters.llama import MLP, Attention, RMSNorm
from exporters.spec import ModelSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Buffers whose values the exporter computes (everything else in the graph comes from the checkpoint).
ROTARY_PREFIX = "model.rotary_emb."


class HfAttention(Attention):
    """exporters.llama.Attention with per-layer KV heads, an explicit head_dim and optional biases."""

    def __init__(self, config: HfConfig, kv_heads: int) -> None:
        nn.Module.__init__(self)
        self.heads, self.kv_heads, self.head_dim = config.heads, kv_heads, config.head_dim
        hidden, q_width, kv_width = config.hidden, config.heads * config.head_dim, kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_width, hidden, bias=config.o_bias)


class LinearAttention(nn.Module):
    """DeciLM attention replace_with_linear: one hidden x hidden Linear (key self_attn.linear_attn)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    """DeciLM ffn replace_with_linear: one hidden x hidden Linear (checkpoint key mlp.linear_mlp)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_mlp(x)


class HfBlock(nn.Module):
    """[input_layernorm -> attention -> add] unless no_op, then [post norm -> FFN -> add] unless no_op."""

    def __init__(self, config: HfConfig, layer: LayerConfig) -> None:
        super().__init__()
        self.window = layer.sliding_window
        if layer.attention != "none":
            self.input_layernorm = RMSNorm(config.hidden, config.eps)
            self.self_attn = (
                HfAttention(config, layer.kv_heads)
                if layer.attention == "gqa"
                else LinearAttention(config.hidden)
            )
        if layer.ffn != "none":
            self.post_attention_layernorm = RMSNorm(config.hidden, config.eps)
            self.mlp = (
                MLP(config.hidden, layer.ffn_width) if layer.ffn == "swiglu" else LinearMLP(config.hidden)
            )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masks: dict[int | None, torch.Tensor]
    ) -> torch.Tensor:
        if hasattr(self, "self_attn"):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, masks[self.window])
        if hasattr(self, "mlp"):
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


def rope_parameters(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [head_dim / 2], attention factor) as transformers computes them.

    For dynamic NTK these are the unscaled frequencies; RotaryEmbedding rescales the base in the graph.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
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
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos, sin [1, 1, seq, head_dim] in float32 for positions 0..seq-1 (times the attention factor)."""

    def __init__(self, config: HfConfig) -> None:
        super().__init__()
        self.rope, self.head_dim = config.rope, config.head_dim
        inv_freq, self.attention_factor = rope_parameters(config.rope, config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        self.register_buffer("exponents", exponents, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq if self.rope.rope_type != "dynamic" else self._dynamic(positions)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return (
            (angles.cos() * self.attention_factor)[None, None],
            (angles.sin() * self.attention_factor)[None, None],
        )

    def _dynamic(self, positions: torch.Tensor) -> torch.Tensor:
        # transformers' dynamic NTK for a fresh model: base grows once seq passes max_position_embeddings.
        rope, dim = self.rope, self.head_dim
        seq = torch.clamp(positions[-1:] + 1, min=float(rope.max_positions))
        base = rope.theta * ((rope.factor * seq / rope.max_positions) - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
        return 1.0 / (base**self.exponents)


class HfBackbone(nn.Module):
    def __init__(self, config: HfConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(HfBlock(config, layer) for layer in config.layers)
        self.norm = RMSNorm(config.hidden, config.eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.windows = sorted({layer.sliding_window for layer in config.layers if layer.sliding_window})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        positions = torch.arange(seq, dtype=torch.float32, device=input_ids.device)
        cos, sin = self.rotary_emb(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        masks = {None: self._mask(seq, None, x)} | {w: self._mask(seq, w, x) for w in self.windows}
        for layer in self.layers:
            x = layer(x, cos, sin, masks)
        return self.norm(x)

    @staticmethod
    def _mask(seq: int, window: int | None, x: torch.Tensor) -> torch.Tensor:
        """Additive [1, 1, seq, seq]: causal, and with a window, key > query - window (transformers')."""
        causal = torch.full((seq, seq), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        if window is None:
            return causal[None, None]
        too_old = torch.full((seq, seq), float("-inf"), dtype=x.dtype, device=x.device).tril(-window)
        return (causal + too_old)[None, None]


class HfCausalLM(nn.Module):
    """forward(input_ids int64 [batch, seq]) -> logits float32 [batch, seq, vocab]."""

    def __init__(self, config: HfConfig) -> None:
        super().__init__()
        self.config = config
        self.model = HfBackbone(config)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids)).float()


def build_meta_model(config: HfConfig, dtype: torch.dtype) -> HfCausalLM:
    """The model on the meta device (no weight memory), parameters in `dtype`, rotary buffers float32."""
    with torch.device("meta"):
        model = HfCausalLM(config)
    model.to(dtype)
    model.model.rotary_emb.float()
    return model.eval()


def rotary_buffers(config: HfConfig) -> dict[str, torch.Tensor]:
    """The real values of the model's computed buffers, by their names in the model."""
    rotary = RotaryEmbedding(config)
    return {ROTARY_PREFIX + name: value for name, value in rotary.named_buffers()}


def parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter name, mapped to all names of the same tensor (tied weights have two)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {name: names for names in by_id.values() for name in names}


@dataclass
class Traceable:
    """A meta model and what torch.onnx.export needs to trace it, and the real values of its buffers."""

    model: nn.Module
    args: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: Any
    buffers: dict[str, torch.Tensor]
    name_dims: Callable[[Any], None]
    metadata: dict[str, str] = field(default_factory=dict)


def prefill_traceable(config: HfConfig, dtype: torch.dtype) -> Traceable:
    """forward(input_ids) -> logits, as exporters.onnx_export writes every model."""
    from exporters.onnx_export import EXAMPLE_SHAPE, _name_dims

    example = torch.zeros(EXAMPLE_SHAPE, dtype=torch.int64, device="meta")
    return Traceable(
        build_meta_model(config, dtype),
        (example,),
        ["input_ids"],
        ["logits"],
        {"input_ids": {0: "batch", 1: "seq"}},
        rotary_buffers(config),
        _name_dims,
    )


def decode_traceable(config: HfConfig, spec: ModelSpec) -> Traceable:
    """exporters.decode's DecodeLlama (float32, KV cache for attention layers), on the meta device.

    Its rotary frequencies are this checkpoint's (linear and llama3 scaling are fixed frequencies).
    """
    from exporters import decode

    with torch.device("meta"):
        model = decode.DecodeLlama(spec).eval()
    batch, seq, past_len = decode.EXAMPLE_BATCH, decode.EXAMPLE_SEQ, decode.EXAMPLE_PAST
    ids = torch.zeros((batch, seq), dtype=torch.int64, device="meta")
    mask = torch.ones((batch, past_len + seq), dtype=torch.int64, device="meta")
    shape = (batch, spec.kv_heads, past_len, spec.resolved_head_dim)
    past = [torch.zeros(shape, device="meta") for b in spec.blocks if b.attention for _ in range(2)]
    layers = model.cache_layers
    inputs = ["input_ids", "attention_mask", *[n for i in layers for n in decode.past_names(i)]]
    outputs = ["logits", *[n for i in layers for n in decode.present_names(i)]]
    dynamic = (
        {0: "batch", 1: "seq"},
        {0: "batch", 1: "total"},
        tuple({0: "batch", 2: "past_len"} for _ in past),
    )
    inv_freq, _ = rope_parameters(config.rope, config.head_dim)
    description = {
        "format": decode.FORMAT,
        "cache_layers": layers,
        "kv_heads": spec.kv_heads,
        "head_dim": spec.resolved_head_dim,
        "vocab": spec.vocab,
        "n_blocks": spec.n_blocks,
    }
    return Traceable(
        model,
        (ids, mask, *past),
        inputs,
        outputs,
        dynamic,
        {"model.inv_freq": inv_freq},
        decode._name_dims,
        {decode.METADATA_KEY: json.dumps(description)},
    )
