"""FP8 checkpoints as NVIDIA Model Optimizer's Hugging Face export writes them (docs/deploy.md "FP8").

Each quantized linear layer `X` (attention q/k/v/o, FFN gate/up/down, the Linear replacements; never the
embedding, the norms or lm_head, which ModelOpt excludes by default) is stored as

    X.weight        float8_e4m3fn [out, in]      round-to-nearest of clip(W / weight_scale, -448, 448)
    X.weight_scale  float32                      "per-channel": [out, 1], amax of the row / 448
                                                 "per-tensor":  [],      amax of the tensor / 448
    X.input_scale   float32 []                   "per-tensor" only: the activation scale (calibration)

with `hf_quant_config.json` {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": ...,
"kv_cache_quant_algo": null, "exclude_modules": ["lm_head"]}} and the same under `quantization_config`
(`"quant_method": "modelopt"`) in config.json. vLLM (`--quantization modelopt`) and TensorRT-LLM read both
algorithms: "FP8_PER_CHANNEL_PER_TOKEN" (per-channel weight scales, activations quantized per token at
run time) and "FP8" (per-tensor weight scale, static per-tensor activation scale).

"per-channel" is the default because it is this project's FP8 weight form (passes.quant.fp8: scale per
output channel, amax / 448, cast to the weight's dtype): the weights are the FP8 ONNX's to the bit.
ModelOpt's per-channel algorithm has no static activation scale, so the calibration is not used there.
"per-tensor" writes the static activation scales from this project's calibration file, with one weight
scale per tensor (the form ModelOpt's "FP8" has; its weights then differ from the per-channel ONNX's).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from exporters.nas.layout import NasLayout, TensorSource
from exporters.nas.safetensors_out import OutTensor, band_rows, out_tensor, write_bands
from passes.errors import UserError
from passes.patterns.linear import find_linears
from passes.quant.calibrate import FP8_MAX, ActivationScales

FP8_MODES = ("per-channel", "per-tensor")  # also in exporters.nas.export (loaded before onnx_ir)
QUANT_ALGOS = {"per-channel": "FP8_PER_CHANNEL_PER_TOKEN", "per-tensor": "FP8"}
EXCLUDED = ["lm_head"]


def fp8_tensors(
    layout: NasLayout, model: ir.Model, dtype: str, mode: str, scales: ActivationScales | None
) -> tuple[list[OutTensor], dict]:
    """The output tensors with every linear layer in FP8 (the rest in `dtype`), and the quantization config
    ({"hf_quant_config": ..., "config_json": ...})."""
    activations = _activation_names(model) if mode == "per-tensor" else {}
    tensors: list[OutTensor] = []
    for source in layout.tensors:
        if not source.linear or source.name == "lm_head.weight" or source.tensor is None:
            tensors.append(out_tensor(source, dtype))
            continue
        base = source.name.removesuffix(".weight")
        stored = source.tensor.dtype.numpy()
        if mode == "per-channel":
            scale = channel_scales(source, stored)
            tensors.append(_fp8_weight(source, scale))
            tensors.append(_array(f"{base}.weight_scale", scale.reshape(-1, 1)))
        else:
            scale = np.float32(np.float32(_amax(source)) / np.float32(FP8_MAX))
            scale = np.float32(scale if scale > 0 and np.isfinite(scale) else 1.0)
            tensors.append(_fp8_weight(source, np.full((source.height,), scale, np.float32)))
            tensors.append(_array(f"{base}.weight_scale", np.array(scale, np.float32)))
            name = activations.get(id(source.tensor))
            if name is None or name not in scales.scales:
                raise UserError(
                    f"--fp8-scales has no activation scale for {source.name} (tensor {name!r}): calibrate "
                    "this graph (tools/build_engines.py --calibrate / passes.quant.calibrate)"
                )
            tensors.append(_array(f"{base}.input_scale", np.array(scales.scales[name], np.float32)))
    algo = QUANT_ALGOS[mode]
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": EXCLUDED}
    config = {
        "hf_quant_config": {
            "producer": {"name": "modelopt", "version": "ffn-fusion"},
            "quantization": quantization,
        },
        "config_json": {"quant_method": "modelopt", **quantization},
    }
    return tensors, config


def channel_scales(source: TensorSource, stored: np.dtype) -> np.ndarray:
    """amax / 448 per output row, cast to the stored dtype and back (passes.quant.fp8's rule), float32."""
    step = band_rows(source.shape[-1])
    amax = np.concatenate([
        np.abs(source.read(first, min(first + step, source.height)).astype(np.float32)).max(axis=1)
        for first in range(0, source.height, step)
    ])
    scale = np.where((amax > 0) & np.isfinite(amax), amax / FP8_MAX, 1.0)
    return scale.astype(stored).astype(np.float32)


def _amax(source: TensorSource) -> float:
    step = band_rows(source.shape[-1])
    return max(
        float(np.abs(source.read(first, min(first + step, source.height)).astype(np.float32)).max())
        for first in range(0, source.height, step)
    )


def _fp8_weight(source: TensorSource, row_scales: np.ndarray) -> OutTensor:
    """float8_e4m3fn [out, in], quantized band by band while it is written."""

    def write(fd: int, offset: int) -> int:
        step = band_rows(source.shape[-1])

        def bands():
            for first in range(0, source.height, step):
                stop = min(first + step, source.height)
                band = source.read(first, stop).astype(np.float32, copy=False)
                scale = row_scales[first:stop, None]
                yield np.clip(band / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)

        return write_bands(fd, offset, bands())

    return OutTensor(source.name, "float8_e4m3fn", source.shape, write)


def _array(name: str, array: np.ndarray) -> OutTensor:
    array = np.array(array, dtype=np.float32, order="C")  # ascontiguousarray would make a scalar [1]
    return OutTensor(
        name, "float32", tuple(array.shape), lambda fd, offset: write_bands(fd, offset, iter([array]))
    )


def _activation_names(model: ir.Model) -> dict[int, str]:
    """id(weight tensor) -> the name of the activation its linear layer reads (the calibration's key)."""
    names = {}
    for linear in find_linears(model.graph):
        names[id(linear.weight.tensor)] = linear.activation.name
    return names
