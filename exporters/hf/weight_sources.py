"""Which checkpoint tensor fills each weight of the exported graph, checked against config.json.

    config, sources, dtype = check_folder(folder)     # sources: graph initializer -> WeightSource

The graph's weights are initializers named as their checkpoint tensors (exporters.hf.config.expected_tensors
lists them with the shapes config.json gives); every one must be in the checkpoint with that shape, and
every checkpoint tensor must have a place in the model. No torch, no numpy: this runs before the copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from exporters.hf.config import DTYPES, HfConfig, expected_tensors, read_config
from exporters.hf.safetensors_in import SAFETENSORS_DTYPES, Checkpoint, TensorEntry, open_checkpoint
from passes.errors import UserError
from passes.metadata import DROPPED_ATTENTION_KEY

# Tensors some checkpoints carry that no computation reads.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightSource:
    """Where an initializer's bytes come from."""

    initializer: str
    entry: TensorEntry
    shape: tuple[int, ...]


def check_folder(
    folder: str | os.PathLike, dtype: str | None = None
) -> tuple[HfConfig, dict[str, WeightSource], str]:
    """Read and check config.json and the safetensors headers (no torch): config, weight sources, dtype."""
    folder = Path(folder)
    config = read_config(folder)
    dtype = dtype or config.dtype
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return config, find_weight_sources(config, open_checkpoint(folder)), dtype


def find_weight_sources(config: HfConfig, checkpoint: Checkpoint) -> dict[str, WeightSource]:
    """Map each tensor the model reads to the checkpoint tensor that fills it, checking every shape.

    A tied lm_head is also listed under "lm_head.weight" (the exporter may name the shared initializer
    either way). Raises UserError for a missing tensor, a shape that contradicts config.json, or a tensor
    that config.json has no place for.
    """
    sources: dict[str, WeightSource] = {}
    for name, (shape, config_field) in expected_tensors(config).items():
        entry = checkpoint.tensors.get(name)
        if entry is None:
            raise UserError(
                f"{checkpoint.folder}: tensor {name!r} is missing from the checkpoint "
                f"(config.json field {config_field})"
            )
        if entry.shape != shape:
            raise UserError(
                f"{entry.file}: tensor {name!r} has shape {list(entry.shape)} but config.json "
                f"(field {config_field}) gives {list(shape)}"
            )
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise UserError(
                f"{entry.file}: tensor {name!r} has dtype {entry.dtype}; "
                f"expected one of {', '.join(SAFETENSORS_DTYPES)}"
            )
        sources[name] = WeightSource(name, entry, shape)
    if config.tie_embeddings:
        embedding = sources["model.embed_tokens.weight"]
        sources["lm_head.weight"] = WeightSource("lm_head.weight", embedding.entry, embedding.shape)
    used = {s.entry.name for s in sources.values()}
    dropped = _dropped_attention_tensors(config)
    for name, entry in checkpoint.tensors.items():
        if name not in used and name not in dropped and not name.endswith(IGNORED_SUFFIXES):
            if name == "lm_head.weight" and config.tie_embeddings:
                continue  # some tied checkpoints store the copy too; the embedding is the one read
            raise UserError(
                f"{entry.file}: tensor {name!r} has no place in the model config.json describes "
                f"(field {_field_of(config, name)})"
            )
    return sources


def _dropped_attention_tensors(config: HfConfig) -> set[str]:
    """Attention tensors of layers whose attention exporters.hf.folder dropped (o_proj zero): unused."""
    dropped = config.raw.get(DROPPED_ATTENTION_KEY) or []
    names = {"input_layernorm.weight"} | {
        f"self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")
    }
    return {f"model.layers.{i}.{n}" for i in dropped for n in names}


def _field_of(config: HfConfig, name: str) -> str:
    """The config.json field that sets this tensor's shape or presence."""
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) < len(config.layers):
        layer = config.layers[int(parts[2])]
        if parts[3] in ("mlp", "post_attention_layernorm"):
            return layer.ffn_field if config.is_deci else "intermediate_size"
        if parts[3] in ("self_attn", "input_layernorm"):
            return layer.attention_field if config.is_deci else "num_key_value_heads, head_dim"
        return "num_hidden_layers"
    if parts[0] == "lm_head" or "embed_tokens" in name:
        return "vocab_size, hidden_size, tie_word_embeddings"
    if len(parts) > 2 and parts[1] == "layers":
        return "num_hidden_layers" if not config.is_deci else "block_configs"
    return "hidden_size"
