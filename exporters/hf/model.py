"""The torch model the --decode graph of a Hugging Face checkpoint is traced from, with its parameter names.

`decode_traceable` builds exporters.decode's DecodeLlama for the checkpoint on the meta device (no weight
memory): the ONNX export needs only the parameters' names, shapes and dtypes, and the weights are streamed
into the ONNX file afterwards (exporters.hf.checkpoint). Parameter names are the checkpoint's
(model.layers.N.self_attn.q_proj.weight, ..., lm_head.weight), so an initializer of the exported graph
names the safetensors tensor that fills it. Its rotary frequencies are the checkpoint's
(exporters.hf.rope). The prefill graph is not traced: exporters.hf.graph builds it without torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from exporters import decode
from exporters.hf.config import HfConfig
from exporters.hf.rope import rope_parameters
from exporters.spec import ModelSpec


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
    buffers: dict[str, np.ndarray]
    name_dims: Callable[[Any], None]
    metadata: dict[str, str] = field(default_factory=dict)


def decode_traceable(config: HfConfig, spec: ModelSpec) -> Traceable:
    """exporters.decode's DecodeLlama (float32, KV cache for attention layers), on the meta device.

    Its rotary frequencies are this checkpoint's (linear and llama3 scaling are fixed frequencies).
    """

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
