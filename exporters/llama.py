"""A hand-written Llama / DeciLM-style model driven by a ModelSpec, with seeded random weights.

Module names follow Hugging Face Llama (model.layers.N.self_attn.q_proj, mlp.gate_proj, ...), so the
dynamo exporter's name scopes read like those of a real checkpoint. A block without attention has no
input norm and no attention (DeciLM / Puzzle): x = x + mlp(post_attention_layernorm(x)).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from exporters.spec import ModelSpec


class RMSNorm(nn.Module):
    """The Hugging Face form: weight * (x.float() * rsqrt(mean(x^2) + eps))."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SelfAttention(nn.Module):
    """Causal grouped-query attention with rotary position embeddings, no biases."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.resolved_head_dim
        self.q_proj = nn.Linear(spec.hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.project(x, cos, sin), mask)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, h, s, d] and k, v [b, kv, s, d], with rotary embeddings applied to q and k."""
        q = self.q_proj(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Shapes are written without symbolic batch/seq sizes and GQA broadcasts instead of repeating K/V:
        # the export is faster and the graph has no per-block Shape ops.
        q = q.unflatten(1, (self.kv_heads, self.heads // self.kv_heads))  # b, kv, groups, s, d
        scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * (self.head_dim ** -0.5) + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v.unsqueeze(2)).flatten(1, 2)  # b, h, s, d
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DecoderBlock(nn.Module):
    """One block: [input_layernorm -> self_attn -> residual add] (optional), post norm -> mlp -> add."""

    attention_class: type[SelfAttention] = SelfAttention

    def __init__(self, spec: ModelSpec, index: int) -> None:
        super().__init__()
        self.has_attention = spec.blocks[index].attention
        if self.has_attention:
            self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
            self.self_attn = self.attention_class(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.mlp = MLP(spec.hidden, spec.blocks[index].ffn_width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        if self.has_attention:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    block_class: type[DecoderBlock] = DecoderBlock

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(self.block_class(spec, i) for i in range(spec.n_blocks))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        head_dim = spec.resolved_head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        positions = torch.arange(seq, dtype=torch.float32, device=input_ids.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        mask = torch.full((seq, seq), float("-inf"), device=input_ids.device).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class SpecLlama(nn.Module):
    """forward(input_ids int64 [batch, seq]) -> logits float32 [batch, seq, vocab]."""

    backbone_class: type[Backbone] = Backbone

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = self.backbone_class(spec)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids)).float()


@torch.no_grad()
def init_weights(model: SpecLlama, seed: int = 0) -> None:
    """Seeded random weights; every parameter differs (the exporter merges identical initializers).

    Embedding ~ N(0, 1) so the residual stream has RMS ~1. Linear ~ N(0, 1/fan_in), and the two
    projections that write into the residual stream (o_proj, down_proj) are scaled by 1/sqrt(2 * blocks),
    so the stream stays O(1) over 80 blocks while each block still changes it visibly. Norm weights
    ~ 1 + 0.1 N(0, 1). An untied lm_head ~ N(0, 1/hidden).
    """
    gen = torch.Generator().manual_seed(seed)
    residual_scale = 1.0 / math.sqrt(2 * model.spec.n_blocks)
    for name, param in model.named_parameters():  # tied weights appear once
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            value = 1.0 + 0.1 * noise
        elif name == "model.embed_tokens.weight":
            value = noise
        else:
            value = noise / math.sqrt(param.shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                value = value * residual_scale
        param.copy_(value)


def build_model(spec: ModelSpec, seed: int = 0) -> SpecLlama:
    """A SpecLlama in eval mode with `init_weights(seed)`."""
    model = SpecLlama(spec)
    init_weights(model, seed)
    return model.eval()


def count_parameters(module: nn.Module) -> int:
    """Number of distinct parameter values (tied weights counted once)."""
    return sum(p.numel() for p in module.parameters())
