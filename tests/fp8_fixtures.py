"""Models and helpers for the FP8 / TensorRT tests (imported by tests/passes/quant/test_fp8.py,
tests/passes/patterns/test_linear.py, tests/exporters/tensorrt/ and tests/tools/test_build_engines.py).

MODELS maps a kind to a builder `(folder) -> model.onnx`. Exports happen once per pytest process
(cached here), so these test files share them. To test the fused SmolLM2 later, register a builder:

    MODELS["fused_smollm2"] = lambda folder: ...  # e.g. exporters.llama / passes.fuse output
    and add the kind to a test's `MODEL_KINDS` list (thresholds per kind live in FP8_BOUNDS).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from passes.io.sessions import ORT_DISABLED_OPTIMIZERS

VOCAB = 256
HIDDEN = 64

# FP8 vs fp32 logits in ONNX Runtime, measured on these models (docs/fp8_tensorrt.md); the bounds leave
# margin over the measurements. (kind, quantize_lm_head) -> (max rel error, min mean cosine, min token cosine)
FP8_BOUNDS: dict[tuple[str, bool], tuple[float, float, float]] = {
    ("tiny_llama", False): (0.05, 0.998, 0.993),
    ("tiny_llama", True): (0.07, 0.997, 0.99),
    ("wide_ffn", False): (0.07, 0.997, 0.99),
    ("wide_ffn", True): (0.08, 0.996, 0.988),
}


def export_tiny_llama(
    path: Path, *, layers: int = 2, intermediate: int = 128, tie: bool = False, seed: int = 0
) -> Path:
    """A transformers LlamaForCausalLM (hidden 64, vocab 256, randomized norm weights) -> ONNX (dynamo)."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only when the model is not cached)
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only when the model is not cached)

    from exporters.onnx_export import export_onnx  # noqa: PLC0415 (imports torch: only when the model is not cached)

    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)

    export_onnx(model, path, external_data_threshold=0)  # logits, no cache; weights in <name>.data
    return path


MODELS: dict[str, Callable[[Path], Path]] = {
    # Tied embeddings like SmolLM2: the lm_head reads Transpose(embedding weight).
    "tiny_llama": lambda folder: export_tiny_llama(folder / "tiny_llama.onnx", tie=True, seed=2),
    # "Fused-like": an FFN 16x the hidden size, i.e. the wide MatMuls a fused FFN group becomes.
    "wide_ffn": lambda folder: export_tiny_llama(folder / "wide_ffn.onnx", intermediate=1024, seed=1),
}

_cache: dict[str, Path] = {}
_root: list[Path] = []


def model_path(kind: str, tmp_path_factory) -> Path:
    """The exported model of this kind (exported on first use in this pytest process)."""
    if kind not in _cache:
        if not _root:
            _root.append(tmp_path_factory.mktemp("fp8_models"))
        folder = _root[0] / kind
        folder.mkdir(exist_ok=True)
        _cache[kind] = MODELS[kind](folder)
    return _cache[kind]


def calib_batches(n: int = 4, batch: int = 2, seq: int = 32, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int64) for _ in range(n)]


def eval_ids(seed: int = 123) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(2, 48), dtype=np.int64)


@functools.cache
def _session(path: str):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        path, options, providers=["CPUExecutionProvider"], disabled_optimizers=ORT_DISABLED_OPTIMIZERS
    )


def run_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return _session(str(path)).run(["logits"], {"input_ids": ids})[0]


def logits_metrics(test: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """(relative error ||t - r|| / ||r||, mean per-token cosine, min per-token cosine)."""
    t = test.reshape(-1, test.shape[-1]).astype(np.float64)
    r = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    rel = float(np.linalg.norm(t - r) / np.linalg.norm(r))
    cos = np.sum(t * r, axis=1) / (np.linalg.norm(t, axis=1) * np.linalg.norm(r, axis=1))
    return rel, float(cos.mean()), float(cos.min())


def log(message: str) -> None:
    print(message, file=sys.stderr)
