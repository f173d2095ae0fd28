"""The --decode graph of a Hugging Face checkpoint, traced from a torch model that holds no weights.

    model = trace(decode_traceable(config, spec), opset)    # weight initializers named, without values

`decode_traceable` builds exporters.decode's DecodeLlama for the checkpoint on the meta device (no weight
memory): the ONNX export needs only the parameters' names, shapes and dtypes, and the weights are streamed
into the ONNX file afterwards (exporters.hf.data_file). Parameter names are the checkpoint's
(model.layers.N.self_attn.q_proj.weight, ..., lm_head.weight), so an initializer of the exported graph
names the safetensors tensor that fills it. Its rotary frequencies are the checkpoint's
(exporters.hf.rope). `trace` runs torch.onnx.export(dynamo=True) and the optimizer on it. The prefill
graph is not traced: exporters.hf.prefill_graph builds it without torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from exporters import decode
from exporters.decode_spec import DecodeSpec
from exporters.hf.config import HfConfig
from exporters.hf.rope import rope_parameters
from exporters.onnx_export import dynamo_export, quiet_export, without_slices_split


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


def decode_traceable(config: HfConfig, spec: DecodeSpec) -> Traceable:
    """exporters.decode's DecodeLlama (float32), on the meta device. `spec` (exporters.hf.config.decode_spec,
    an exporters.decode_spec.DecodeSpec) gives each layer its kind: GQA with its own KV heads and a cache,
    a Linear or nothing for attention; SwiGLU, a Linear or nothing for the FFN.

    Its rotary frequencies are this checkpoint's (linear and llama3 scaling are fixed frequencies).
    """

    with torch.device("meta"):
        model = decode.DecodeLlama(spec).eval()
    example = decode.trace_inputs(spec, device="meta")
    inv_freq, _ = rope_parameters(config.rope, config.head_dim)
    return Traceable(
        model,
        example.args,
        example.input_names,
        example.output_names,
        example.dynamic_shapes,
        {"model.inv_freq": inv_freq},
        decode._name_dims,
        {decode.METADATA_KEY: json.dumps(decode.describe(spec))},
    )


def trace(traceable: Traceable, opset: int | None) -> ir.Model:
    """The optimized graph of a meta model; weight initializers keep their names and have no value."""
    parameters = set(parameter_aliases(traceable.model))
    with quiet_export(), torch.no_grad(), _quiet_logger("onnx_ir"):
        program = dynamo_export(
            traceable.model,
            traceable.args,
            opset=opset,
            optimize=False,
            input_names=traceable.input_names,
            output_names=traceable.output_names,
            dynamic_shapes=traceable.dynamic_shapes,
        )
        for name, value in program.model.graph.initializers.items():
            if name in traceable.buffers:
                value.const_value = ir.tensor(traceable.buffers[name], name=name)
            elif name in parameters:
                value.const_value = None  # the optimizer neither reads nor folds a value it does not have
            else:
                raise RuntimeError(f"exported graph has an unexpected initializer {name!r}")
        with without_slices_split():  # the same graph, without a quadratic rule that never fires
            program.optimize()
    onnx_model = program.model
    traceable.name_dims(onnx_model)
    onnx_model.metadata_props.update(traceable.metadata)
    return onnx_model


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """onnx-ir warns once per weight that it skips deduplicating value-less initializers: expected here."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
