"""Read a Hugging Face config.json into a per-layer description (no torch needed).

Two kinds of checkpoint are understood:

- the Llama family: LlamaForCausalLM, MistralForCausalLM (sliding window), Qwen2ForCausalLM (q/k/v bias,
  per-layer sliding window); every layer has attention with `num_key_value_heads` KV heads and a SwiGLU
  FFN of width `intermediate_size`;
- DeciLMForCausalLM / nemotron-nas (design §7): each layer's `block_configs` entry says whether attention
  is absent (no_op), one hidden x hidden Linear (replace_with_linear) or GQA with
  num_attention_heads / n_heads_in_group KV heads, and whether the FFN is absent, a Linear, or SwiGLU of
  width ceil256(int(2 * ffn_mult * hidden / 3)).

Every error is a UserError naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporters.decode_spec import DecodeSpec, LayerKind
from exporters.spec import BlockSpec, ffn_width
from passes.errors import UserError
from passes.metadata import DROPPED_ATTENTION_KEY

LLAMA_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
DECI = "DeciLMForCausalLM"
DTYPES = ("float32", "float16", "bfloat16")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# exporters.hf.folder's config key: layers whose attention was dropped (their o_proj is zero).

# block_configs fields: the ones with a meaning here, and the ones accepted only at their neutral value.
ATTENTION_FIELDS = {"no_op", "replace_with_linear", "n_heads_in_group"}
FFN_FIELDS = {"no_op", "replace_with_linear", "ffn_mult"}
NEUTRAL_FIELDS = {
    "attention": {
        "sparsify": None,
        "num_sink_tokens": None,
        "unshifted_sink": False,
        "use_prefill_window_in_sink_attention": False,
        "window_length": None,
    },
    "ffn": {"sparsify": None},
}


@dataclass(frozen=True)
class LayerConfig:
    """One decoder layer. attention: "gqa" | "linear" | "none"; ffn: "swiglu" | "linear" | "none"."""

    attention: str
    kv_heads: int
    ffn: str
    ffn_width: int
    sliding_window: int | None = None
    # The config.json fields that set this layer's shapes (for error messages).
    attention_field: str = "num_key_value_heads"
    ffn_field: str = "intermediate_size"


@dataclass(frozen=True)
class RopeConfig:
    """rope_scaling / rope_parameters as transformers reads them."""

    rope_type: str
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 0
    max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass
class HfConfig:
    """What the exporter needs from config.json."""

    path: Path
    architecture: str
    model_type: str
    hidden: int
    heads: int
    head_dim: int
    vocab: int
    eps: float
    rope: RopeConfig
    tie_embeddings: bool
    dtype: str
    layers: list[LayerConfig] = field(default_factory=list)
    qkv_bias: bool = False
    o_bias: bool = False
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def is_deci(self) -> bool:
        return self.architecture == DECI

    @property
    def attention_flags(self) -> list[bool]:
        """Per layer: is there anything (softmax attention or its Linear replacement) in the attention slot?

        Only layers without it can be fused with their neighbours' FFNs."""
        return [layer.attention != "none" for layer in self.layers]


def expected_tensors(config: HfConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every checkpoint tensor the model reads: name -> (shape, the config.json field that sets it)."""
    hidden, head_dim = config.hidden, config.head_dim
    vocab_field = "vocab_size, hidden_size"
    tensors = {"model.embed_tokens.weight": ((config.vocab, hidden), vocab_field)}
    for i, layer in enumerate(config.layers):
        prefix = f"model.layers.{i}"
        a_field = layer.attention_field if config.is_deci else "num_key_value_heads, head_dim, hidden_size"
        f_field = layer.ffn_field if config.is_deci else "intermediate_size, hidden_size"
        if layer.attention != "none":
            tensors[f"{prefix}.input_layernorm.weight"] = ((hidden,), "hidden_size")
        if layer.attention == "linear":
            tensors[f"{prefix}.self_attn.linear_attn.weight"] = ((hidden, hidden), a_field)
        elif layer.attention == "gqa":
            widths = {
                "q": config.heads * head_dim,
                "k": layer.kv_heads * head_dim,
                "v": layer.kv_heads * head_dim,
            }
            for p, width in widths.items():
                tensors[f"{prefix}.self_attn.{p}_proj.weight"] = ((width, hidden), a_field)
                if config.qkv_bias:
                    tensors[f"{prefix}.self_attn.{p}_proj.bias"] = ((width,), a_field + ", attention_bias")
            tensors[f"{prefix}.self_attn.o_proj.weight"] = ((hidden, widths["q"]), a_field)
            if config.o_bias:
                tensors[f"{prefix}.self_attn.o_proj.bias"] = ((hidden,), "attention_bias")
        if layer.ffn != "none":
            tensors[f"{prefix}.post_attention_layernorm.weight"] = ((hidden,), "hidden_size")
        if layer.ffn == "linear":
            tensors[f"{prefix}.mlp.linear_mlp.weight"] = ((hidden, hidden), f_field)
        elif layer.ffn == "swiglu":
            width = layer.ffn_width
            tensors[f"{prefix}.mlp.gate_proj.weight"] = ((width, hidden), f_field)
            tensors[f"{prefix}.mlp.up_proj.weight"] = ((width, hidden), f_field)
            tensors[f"{prefix}.mlp.down_proj.weight"] = ((hidden, width), f_field)
    tensors["model.norm.weight"] = ((hidden,), "hidden_size")
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = ((config.vocab, hidden), vocab_field + ", tie_word_embeddings")
    return tensors


class _Reader:
    """Typed access to config.json fields with one-line errors naming the file and the field."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data

    def fail(self, name: str, problem: str) -> UserError:
        return UserError(f"{self.path}: field {name!r} {problem}")

    def int(self, name: str, default: Any = ..., data: dict | None = None, minimum: int = 1) -> int:
        value = self._get(name, default, data)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(name, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def float(self, name: str, default: Any = ..., data: dict | None = None, positive: bool = True) -> float:
        value = self._get(name, default, data)
        if isinstance(value, bool) or not isinstance(value, int | float) or (positive and value <= 0):
            raise self.fail(name, f"must be a {'positive ' if positive else ''}number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: Any = ..., data: dict | None = None) -> bool:
        value = self._get(name, default, data)
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value

    def _get(self, name: str, default: Any, data: dict | None) -> Any:
        source = self.data if data is None else data
        key = name.rsplit(".", 1)[-1]
        if key in source and source[key] is not None:
            return source[key]
        if default is ...:
            raise self.fail(name, "is missing")
        return default


def read_config(folder: str | Path) -> HfConfig:
    """Parse `folder/config.json`; raises UserError naming the field for anything not understood."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(
            f"{path} not found: --hf takes a Hugging Face model folder (config.json, *.safetensors)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object")
    r = _Reader(path, data)
    architectures = data.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise r.fail("architectures", f"must list one architecture, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in LLAMA_FAMILY and architecture != DECI:
        known = ", ".join([*LLAMA_FAMILY, DECI])
        raise r.fail(
            "architectures", f"names {architecture!r}, which this exporter does not know (known: {known})"
        )
    if data.get("hidden_act", "silu") != "silu":
        raise r.fail("hidden_act", f"is {data['hidden_act']!r}; only SwiGLU (silu) FFNs are supported")
    if data.get("mlp_bias"):
        raise r.fail("mlp_bias", "is true; FFN biases are not supported")
    if data.get("partial_rotary_factor", 1.0) != 1.0:
        raise r.fail("partial_rotary_factor", "must be 1.0 (rotary over the whole head)")
    hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
    head_dim = r.int("head_dim", hidden // heads)
    if head_dim % 2:
        raise r.fail("head_dim", f"must be even (rotary), got {head_dim}")
    dtype = data.get("dtype") or data.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise r.fail("torch_dtype", f"is {dtype!r}; expected one of {', '.join(DTYPES)}")
    config = HfConfig(
        path=path,
        architecture=architecture,
        model_type=str(data.get("model_type", "")),
        hidden=hidden,
        heads=heads,
        head_dim=head_dim,
        vocab=r.int("vocab_size"),
        eps=r.float("rms_norm_eps"),
        rope=_rope(r),
        tie_embeddings=r.bool("tie_word_embeddings", False),
        dtype=dtype,
        raw=data,
    )
    if architecture == DECI:
        config.layers = _deci_layers(r, config)
    else:
        config.layers = _llama_layers(r, config)
        bias = r.bool("attention_bias", False)
        config.qkv_bias = bias or architecture == "Qwen2ForCausalLM"
        config.o_bias = bias and architecture != "Qwen2ForCausalLM"
    _drop_attention(r, config)
    return config


def _rope(r: _Reader) -> RopeConfig:
    params = r.data.get("rope_parameters") or r.data.get("rope_scaling") or {}
    name = "rope_parameters" if r.data.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise r.fail(name, f"must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise r.fail(f"{name}.rope_type", f"is {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    theta = (
        r.float(f"{name}.rope_theta", None, params)
        if params.get("rope_theta") is not None
        else r.float("rope_theta", 10000.0)
    )
    max_positions = r.int("max_position_embeddings", 2048)
    if rope_type == "default":
        return RopeConfig("default", theta, max_positions=max_positions)
    original = r.int(
        f"{name}.original_max_position_embeddings",
        r.data.get("original_max_position_embeddings") or max_positions,
        params,
    )
    # yarn may leave the factor out: transformers then derives it from the two lengths.
    derived = max_positions / original if rope_type == "yarn" else ...
    factor = r.float(f"{name}.factor", derived, params)
    optional = {
        k: r.float(f"{name}.{k}", None, params, positive=False)
        for k in ("mscale", "mscale_all_dim", "attention_factor")
        if params.get(k) is not None
    }
    return RopeConfig(
        rope_type,
        theta,
        factor=factor,
        low_freq_factor=r.float(f"{name}.low_freq_factor", 1.0, params),
        high_freq_factor=r.float(f"{name}.high_freq_factor", 4.0, params),
        original_max_positions=original,
        max_positions=max_positions,
        beta_fast=r.float(f"{name}.beta_fast", 32.0, params),
        beta_slow=r.float(f"{name}.beta_slow", 1.0, params),
        truncate=r.bool(f"{name}.truncate", True, params),
        **optional,
    )


def _llama_layers(r: _Reader, config: HfConfig) -> list[LayerConfig]:
    n_layers, width = r.int("num_hidden_layers"), r.int("intermediate_size")
    kv_heads = r.int("num_key_value_heads", config.heads)
    if config.heads % kv_heads:
        raise r.fail("num_key_value_heads", f"= {kv_heads} must divide num_attention_heads = {config.heads}")
    windows = _sliding_windows(r, n_layers)
    return [LayerConfig("gqa", kv_heads, "swiglu", width, windows[i]) for i in range(n_layers)]


def _sliding_windows(r: _Reader, n_layers: int) -> list[int | None]:
    """Per layer, the sliding attention window (None: full causal attention), as transformers 5 decides."""
    window = r.data.get("sliding_window")
    types = r.data.get("layer_types")
    architecture = r.data["architectures"][0]
    if architecture == "Qwen2ForCausalLM":
        if not r.data.get("use_sliding_window", False):
            window = None
        if types is None:
            first = r.data.get("max_window_layers", n_layers)
            types = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(n_layers)
            ]
    if window is None:
        return [None] * n_layers
    window = r.int("sliding_window", window)
    if types is None:
        return [window] * n_layers
    if not isinstance(types, list) or len(types) != n_layers:
        raise r.fail("layer_types", f"must list {n_layers} layer types")
    return [window if t == "sliding_attention" else None for t in types]


def _deci_layers(r: _Reader, config: HfConfig) -> list[LayerConfig]:
    blocks = r.data.get("block_configs")
    if not isinstance(blocks, list) or not blocks:
        raise r.fail("block_configs", "must be a non-empty list (one entry per layer, docs/design.md §7)")
    n_layers = r.int("num_hidden_layers", len(blocks))
    if n_layers != len(blocks):
        raise r.fail("num_hidden_layers", f"= {n_layers} but block_configs has {len(blocks)} entries")
    return [_deci_layer(r, config, i, block) for i, block in enumerate(blocks)]


def _deci_layer(r: _Reader, config: HfConfig, index: int, block: Any) -> LayerConfig:
    where = f"block_configs[{index}]"
    if not isinstance(block, dict) or set(block) - {"attention", "ffn"}:
        extra = sorted(set(block) - {"attention", "ffn"}) if isinstance(block, dict) else block
        raise r.fail(where, f"has unknown entries {extra!r}; expected 'attention' and 'ffn'")
    attention = _sub_block(r, where, "attention", block.get("attention"), ATTENTION_FIELDS)
    ffn = _sub_block(r, where, "ffn", block.get("ffn"), FFN_FIELDS)
    a_field, f_field = f"{where}.attention", f"{where}.ffn"
    kv_heads, attention_kind = 0, "gqa"
    if r.bool(f"{a_field}.no_op", False, attention):
        attention_kind = "none"
    elif r.bool(f"{a_field}.replace_with_linear", False, attention):
        attention_kind = "linear"
    else:
        group = r.int(f"{a_field}.n_heads_in_group", ..., attention)
        if config.heads % group:
            raise r.fail(
                f"{a_field}.n_heads_in_group", f"= {group} must divide num_attention_heads = {config.heads}"
            )
        kv_heads = config.heads // group
    width, ffn_kind = 0, "swiglu"
    if r.bool(f"{f_field}.no_op", False, ffn):
        ffn_kind = "none"
    elif r.bool(f"{f_field}.replace_with_linear", False, ffn):
        ffn_kind = "linear"
    else:
        width = ffn_width(r.float(f"{f_field}.ffn_mult", ..., ffn), config.hidden)
    return LayerConfig(
        attention_kind,
        kv_heads,
        ffn_kind,
        width,
        None,
        attention_field=f"{a_field}.n_heads_in_group",
        ffn_field=f"{f_field}.ffn_mult",
    )


def _sub_block(r: _Reader, where: str, kind: str, data: Any, fields: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise r.fail(f"{where}.{kind}", f"must be an object, got {data!r}")
    neutral = NEUTRAL_FIELDS[kind]
    for key, value in data.items():
        if key in fields:
            continue
        if key not in neutral:
            raise r.fail(
                f"{where}.{kind}.{key}", f"is unknown; known fields: {sorted(fields | set(neutral))}"
            )
        if value != neutral[key]:
            raise r.fail(f"{where}.{kind}.{key}", f"= {value!r} is not supported (only {neutral[key]!r})")
    return data


def _drop_attention(r: _Reader, config: HfConfig) -> None:
    """Layers listed under DROPPED_ATTENTION_KEY (exporters.hf.folder) lose attention and its input norm."""
    dropped = r.data.get(DROPPED_ATTENTION_KEY) or []
    if not isinstance(dropped, list) or any(
        not isinstance(i, int) or not 0 <= i < len(config.layers) for i in dropped
    ):
        raise r.fail(DROPPED_ATTENTION_KEY, f"must list layer numbers 0-{len(config.layers) - 1}")
    for i in dropped:
        layer = config.layers[i]
        config.layers[i] = LayerConfig(
            "none", 0, layer.ffn, layer.ffn_width, None, layer.attention_field, layer.ffn_field
        )


def layer_kinds(config: HfConfig) -> list[str]:
    """Per layer, a short description: 'gqa(kv=8)+swiglu(28672)', 'none+linear', ..."""
    kinds = []
    for layer in config.layers:
        attention = f"gqa(kv={layer.kv_heads})" if layer.attention == "gqa" else layer.attention
        ffn = f"swiglu({layer.ffn_width})" if layer.ffn == "swiglu" else layer.ffn
        kinds.append(f"{attention}+{ffn}")
    return kinds


def decode_spec(config: HfConfig, *, torch_model: bool = True) -> DecodeSpec:
    """The exporters.decode spec of this checkpoint, or UserError naming what the torch model lacks.

    Every Nemotron-NAS layer kind is covered: GQA with per-layer KV heads (one cache per such layer, with
    its own head count), attention no_op or one Linear (no cache), SwiGLU of per-layer width, FFN no_op or
    one Linear. exporters/decode.py's torch model (`torch_model`, which runtime.prune runs) lacks attention
    biases, sliding windows, and rotary types other than the fixed-frequency ones (default, linear,
    llama3); the onnx-ir decode graph (exporters.hf.decode_graph, `torch_model=False`) reads all of those
    from the config as the prefill graph does. Both are float32.
    """
    where = f"{config.path}: --decode"
    if torch_model and (config.qkv_bias or config.o_bias):
        raise UserError(f"{where} does not support attention biases (attention_bias / Qwen2)")
    if torch_model and any(layer.sliding_window for layer in config.layers):
        raise UserError(f"{where} does not support sliding-window attention (sliding_window)")
    if torch_model and config.rope.rope_type not in ("default", "linear", "llama3"):
        raise UserError(
            f"{where} supports rope types default, linear and llama3, not {config.rope.rope_type!r}"
        )
    # ffn_width is read for SwiGLU only; a Linear or absent FFN carries the hidden size as a placeholder.
    blocks = [
        BlockSpec(layer.attention != "none", layer.ffn_width if layer.ffn == "swiglu" else config.hidden)
        for layer in config.layers
    ]
    kinds = [LayerKind(layer.attention, layer.kv_heads, layer.ffn) for layer in config.layers]
    cached = [layer.kv_heads for layer in config.layers if layer.attention == "gqa"]
    return DecodeSpec(
        hidden=config.hidden,
        heads=config.heads,
        kv_heads=cached[0] if cached else config.heads,
        vocab=config.vocab,
        blocks=blocks,
        eps=config.eps,
        rope_theta=config.rope.theta,
        tie_embeddings=config.tie_embeddings,
        head_dim=config.head_dim,
        kinds=kinds,
    )
