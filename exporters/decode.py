"""Decode graphs: one ONNX graph with a KV cache that serves both prefill and single-token decode.

Graph interface (all dims but kv_heads, head_dim and vocab are dynamic):

    inputs   input_ids        int64   [batch, seq]
             attention_mask   int64   [batch, past_len + seq]   1 = real token, 0 = (left) padding
             past_key_<L>     float32 [batch, kv_heads_L, past_len, head_dim]   for GQA layers L only
             past_value_<L>   float32 [batch, kv_heads_L, past_len, head_dim]
    outputs  logits           float32 [batch, seq, vocab]
             present_key_<L>  float32 [batch, kv_heads_L, past_len + seq, head_dim]   (past ++ new keys)
             present_value_<L>

Past tensors come in layer order, key before value. `past_len` may be 0 (prefill from an empty cache).
Rotary positions are computed inside from the mask, the way Hugging Face generation does it:
position = cumsum(attention_mask) - 1 (0 on padding), so left-padded batches rotate each row from its
own first real token. A query attends to cache slots that are not padding and not in its future.
Attention-free blocks (DeciLM / Puzzle) have no cache tensors at all: the paper's halved KV memory.
Layer numbers L are the source model's block indices (they stay the same after fusion).

Layer kinds (exporters.decode_spec; a plain ModelSpec has only the first two): GQA with a cache, no
attention, and for Nemotron-NAS / Puzzle checkpoints each GQA layer with its own KV-head count
(`kv_heads_L`), attention replaced by one Linear (`self_attn.linear_attn`, no cache), the FFN replaced by
one Linear (`mlp.linear_mlp`) or absent.

The wrapper subclasses exporters.llama's SpecLlama, Backbone, DecoderBlock and SelfAttention, so it keeps
their parameter names (model.layers.N.self_attn.q_proj, ...): a SpecLlama's or a Hugging Face Llama's
state dict loads as is, and the residual stream (embedding Gather -> residual Adds -> final norm) is the
one passes.model_map walks in the prefill-only export.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx_ir as ir
import torch
from torch import nn

from exporters.decode_spec import cache_kv_heads, cache_layers, describe, kinds_of
from exporters.llama import MLP, Backbone, DecoderBlock, RMSNorm, SelfAttention, SpecLlama, build_model
from exporters.onnx_export import dynamo_export, save_export
from exporters.smollm2_tokenizer import PRUNED_BLOCKS
from exporters.spec import BlockSpec, ModelSpec
from passes.io.model_io import EXTERNAL_DATA_THRESHOLD
from passes.metadata import DECODE_METADATA_KEY

# Metadata key of the decode graph description (JSON); fusion keeps model metadata.
# Tracing example: batch 2, 7 new tokens after 3 cached ones (no dim 0 or 1, so none is specialized).
EXAMPLE_BATCH, EXAMPLE_SEQ, EXAMPLE_PAST = 2, 7, 3


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_{layer}", f"past_value_{layer}"


def present_names(layer: int) -> tuple[str, str]:
    return f"present_key_{layer}", f"present_value_{layer}"


@dataclass(frozen=True)
class AttentionInputs:
    """What every attention layer of one forward reads besides the stream: rotary cos/sin [b, 1, s, d] and
    the additive attention bias [b, 1, 1, s, total]."""

    cos: torch.Tensor
    sin: torch.Tensor
    bias: torch.Tensor


class CachedAttention(SelfAttention):
    """exporters.llama.SelfAttention (same parameters) with an explicit past K/V concatenated in front."""

    def forward(
        self, x: torch.Tensor, step: AttentionInputs, past: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.project(x, step.cos, step.sin)
        k_all = torch.cat((past[0], k), dim=2)  # b, kv, past + s, d
        v_all = torch.cat((past[1], v), dim=2)
        return self.attend(q, k_all, v_all, step.bias), k_all, v_all


class LinearAttention(nn.Module):
    """A Nemotron-NAS attention replaced by one hidden x hidden Linear (`self_attn.linear_attn`): no cache."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    """A Nemotron-NAS FFN replaced by one hidden x hidden Linear (`mlp.linear_mlp`)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_mlp(x)


class CachedBlock(DecoderBlock):
    """exporters.llama.DecoderBlock with a cache: same parameter names. Its LayerKind (exporters.decode_spec)
    picks the parts: GQA attention with the layer's own KV heads (cached), a Linear or nothing in the
    attention slot; a SwiGLU FFN, a Linear or nothing in the FFN slot."""

    attention_class = CachedAttention

    def __init__(self, spec: ModelSpec, index: int) -> None:
        nn.Module.__init__(self)  # not DecoderBlock's: the parts depend on the layer kind
        kind = kinds_of(spec)[index]
        self.attention, self.ffn = kind.attention, kind.ffn
        self.has_attention = kind.attention != "none"
        self.cached = kind.attention == "gqa"
        if kind.attention != "none":
            self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
        if kind.attention == "gqa":
            self.self_attn = self.attention_class(replace(spec, kv_heads=kind.kv_heads))
        elif kind.attention == "linear":
            self.self_attn = LinearAttention(spec.hidden)
        if kind.ffn != "none":
            self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)
        if kind.ffn == "swiglu":
            self.mlp = MLP(spec.hidden, spec.blocks[index].ffn_width)
        elif kind.ffn == "linear":
            self.mlp = LinearMLP(spec.hidden)

    def forward(
        self, x: torch.Tensor, step: AttentionInputs, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple | None]:
        present = None
        if self.cached:
            assert past is not None
            attn, k_all, v_all = self.self_attn(self.input_layernorm(x), step, past)
            x = x + attn
            present = (k_all, v_all)
        elif self.attention == "linear":
            x = x + self.self_attn(self.input_layernorm(x))
        if self.ffn != "none":
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class CachedBackbone(Backbone):
    block_class = CachedBlock


class DecodeLlama(SpecLlama):
    """forward(input_ids, attention_mask, *past) -> (logits, *present); see the module docstring."""

    backbone_class = CachedBackbone

    @property
    def cache_layers(self) -> list[int]:
        return cache_layers(self.spec)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        seq = input_ids.shape[1]
        total = attention_mask.shape[1]
        past_len = total - seq
        valid = attention_mask > 0
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past_len:].to(torch.float32)  # b, s
        freqs = positions[:, :, None] * self.model.inv_freq[None, None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # b, 1, s, d
        query_slot = torch.arange(seq, device=input_ids.device) + past_len  # cache slot of each query
        key_slot = torch.arange(total, device=input_ids.device)
        allowed = (key_slot[None, :] <= query_slot[:, None])[None] & valid[:, None, :]  # b, s, total
        # A finite "minus infinity": a padding query that sees no key gets a uniform (not NaN) softmax.
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None, None]  # b, 1, 1, s, t
        step = AttentionInputs(cos, sin, bias)
        x = self.model.embed_tokens(input_ids)
        presents: list[torch.Tensor] = []
        cache = iter(past)
        for layer in self.model.layers:
            layer_past = (next(cache), next(cache)) if layer.cached else None
            x, present = layer(x, step, layer_past)
            if present is not None:
                presents.extend(present)
        logits = self.lm_head(self.model.norm(x)).float()
        return (logits, *presents)


# ------------------------------------------------------------------------------------------ building


def decode_model_from_spec(spec: ModelSpec, seed: int = 0) -> DecodeLlama:
    """The decode wrapper holding exactly the weights of `exporters.llama.build_model(spec, seed)`."""
    return decode_model_from(build_model(spec, seed))


def decode_model_from(source: nn.Module) -> DecodeLlama:
    """A DecodeLlama with the weights of a SpecLlama or a Hugging Face LlamaForCausalLM (eval mode)."""
    spec = getattr(source, "spec", None)
    if not isinstance(spec, ModelSpec):
        spec = spec_from_hf(source)
    model = DecodeLlama(spec)
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    model.load_state_dict(state, strict=True)
    return model.eval()


def spec_from_hf(model: nn.Module) -> ModelSpec:
    """The ModelSpec of a Hugging Face Llama (layers replaced by AttentionFreeDecoderLayer lack attention)."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported by the decode exporter (only 'default')")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    blocks = [
        BlockSpec(attention=hasattr(layer, "self_attn"), ffn_width=layer.mlp.gate_proj.out_features)
        for layer in model.model.layers
    ]
    return ModelSpec(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        vocab=config.vocab_size,
        blocks=blocks,
        eps=float(config.rms_norm_eps),
        rope_theta=float(theta),
        tie_embeddings=bool(config.tie_word_embeddings),
        head_dim=getattr(config, "head_dim", None),
    )


def empty_past(
    spec: ModelSpec, batch: int, past_len: int = 0, device: str | torch.device | None = None
) -> list[torch.Tensor]:
    """Zero past tensors for every cached layer (its own KV heads), key then value."""
    dim = spec.resolved_head_dim
    heads = cache_kv_heads(spec)
    return [torch.zeros((batch, kv, past_len, dim), device=device) for kv in heads for _ in range(2)]


@dataclass(frozen=True)
class TraceInputs:
    """The example inputs, names and dynamic shapes torch.onnx traces a DecodeLlama with."""

    args: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: tuple


def trace_inputs(spec: ModelSpec, device: str | torch.device | None = None) -> TraceInputs:
    """Batch 2, 7 new tokens after 3 cached ones (no dim 0 or 1, so none is specialized)."""
    ids = torch.zeros((EXAMPLE_BATCH, EXAMPLE_SEQ), dtype=torch.int64, device=device)
    mask = torch.ones((EXAMPLE_BATCH, EXAMPLE_PAST + EXAMPLE_SEQ), dtype=torch.int64, device=device)
    past = empty_past(spec, EXAMPLE_BATCH, EXAMPLE_PAST, device)
    layers = cache_layers(spec)
    # forward(*past) takes the past tensors as one tuple argument: its dynamic shapes are a tuple too.
    dynamic = (
        {0: "batch", 1: "seq"},
        {0: "batch", 1: "total"},
        tuple({0: "batch", 2: "past_len"} for _ in past),
    )
    return TraceInputs(
        (ids, mask, *past),
        ["input_ids", "attention_mask", *[n for i in layers for n in past_names(i)]],
        ["logits", *[n for i in layers for n in present_names(i)]],
        dynamic,
    )


# ------------------------------------------------------------------------------------------ exporting


@dataclass
class DecodeExport:
    """What `export_decode` wrote."""

    path: Path
    files: list[Path]
    bytes: int
    seconds: float
    spec: ModelSpec
    cache_layers: list[int] = field(default_factory=list)

    @property
    def input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", *[n for i in self.cache_layers for n in past_names(i)]]

    @property
    def output_names(self) -> list[str]:
        return ["logits", *[n for i in self.cache_layers for n in present_names(i)]]


def export_decode(
    model: DecodeLlama,
    path: str | os.PathLike,
    *,
    opset: int | None = None,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
) -> DecodeExport:
    """Export a DecodeLlama through torch.onnx's dynamo exporter (see the module docstring for the I/O)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.eval()
    spec = model.spec
    example = trace_inputs(spec)
    start = time.perf_counter()
    program = dynamo_export(
        model,
        example.args,
        opset=opset,
        optimize=True,
        input_names=example.input_names,
        output_names=example.output_names,
        dynamic_shapes=example.dynamic_shapes,
    )
    onnx_model = program.model
    _name_dims(onnx_model)
    onnx_model.metadata_props[DECODE_METADATA_KEY] = json.dumps(describe(spec))
    files = save_export(onnx_model, path, external_data_threshold)
    return DecodeExport(
        path=path,
        files=files,
        bytes=sum(f.stat().st_size for f in files),
        seconds=time.perf_counter() - start,
        spec=spec,
        cache_layers=model.cache_layers,
    )


def _name_dims(model: ir.Model) -> None:
    """Give the dynamic dims of inputs and outputs readable names: batch, seq, past_len, total."""
    graph = model.graph
    names: dict[str, str] = {}
    wanted = [(graph.inputs[0], {0: "batch", 1: "seq"}), (graph.inputs[1], {1: "total"})]
    wanted += [(v, {2: "past_len"}) for v in graph.inputs[2:3]]
    for value, dims in wanted:
        for axis, name in dims.items():
            dim = value.shape[axis]
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                names.setdefault(dim.value, name)
    for value in [*graph.inputs, *graph.outputs]:
        if value.shape is None:
            continue
        value.shape = ir.Shape([_renamed(d, names) for d in value.shape])


def _renamed(dim: object, names: dict[str, str]) -> object:
    if not isinstance(dim, ir.SymbolicDim) or dim.value is None:
        return dim
    text = dim.value
    for old, new in sorted(names.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(old, new) if old != new else text
    return ir.SymbolicDim("total" if text in ("past_len + seq", "seq + past_len") else text)


def export_spec_decode(spec: ModelSpec, path: str | os.PathLike, seed: int = 0, **kwargs) -> DecodeExport:
    """The decode graph of `build_model(spec, seed)` (the same weights as export_spec_model's)."""
    return export_decode(decode_model_from_spec(spec, seed), path, **kwargs)


def export_smollm2_decode(
    path: str | os.PathLike, drop_attention: Iterable[int] = PRUNED_BLOCKS, **kwargs
) -> DecodeExport:
    """The decode graph of SmolLM2-135M-Instruct with attention removed from `drop_attention` (13-22)."""
    from exporters import smollm2  # noqa: PLC0415 (transformers: seconds to import; only the SmolLM2 export needs it)

    model = smollm2.remove_attention(smollm2.load_torch_model(), drop_attention)
    return export_decode(decode_model_from(model), path, **kwargs)
