"""Every constant of the analytical decode latency model (runtime/latency/), with its source.

Kinds of source: "datasheet" (vendor spec sheet), "paper" (arXiv 2503.18908, FFN Fusion), "measured"
(someone else's published measurement, not of anything this model predicts), "assumption" (a modelling
choice, stated as such), "calibrated" (fit by runtime.latency.fit.fit_overheads() on the named paper
numbers;
tests/runtime/latency/test_latency_model.py re-fits them and fails when the stored values go stale).

A .py module rather than JSON so that it ships with the package without package-data configuration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


CONSTANTS: dict[str, Constant] = {
    # --- Hardware (datasheets) -------------------------------------------------------------------------
    "h100.hbm_bandwidth": Constant(
        3.35e12,
        "B/s",
        "datasheet: NVIDIA H100 Tensor Core GPU datasheet, H100 SXM, GPU memory bandwidth 3.35 TB/s",
    ),
    "h100.fp8_flops": Constant(
        1.979e15,
        "FLOP/s",
        "datasheet: NVIDIA H100 datasheet, H100 SXM FP8 Tensor Core 3,958 TFLOPS with sparsity, dense half",
    ),
    "h200.hbm_bandwidth": Constant(
        4.8e12,
        "B/s",
        "datasheet: NVIDIA H200 Tensor Core GPU datasheet, H200 SXM, GPU memory bandwidth 4.8 TB/s",
    ),
    "h200.fp8_flops": Constant(
        1.979e15,
        "FLOP/s",
        "datasheet: NVIDIA H200 datasheet, H200 SXM FP8 Tensor Core 3,958 TFLOPS with sparsity, dense half",
    ),
    # --- All-reduce (same NVLink 4 / NVSwitch fabric on HGX H100 and HGX H200) --------------------------
    "allreduce.latency": Constant(
        5.9e-6,
        "s",
        "measured: sgl-project/sglang PR #2904, TensorRT-LLM-derived custom all-reduce on 8xH100, TP 8, "
        "512 B message: 0.0059 ms (without CUDA graph, so the all-reduce kernel's own launch is inside it). "
        "H200: assumed the same (same NVLink 4 / NVSwitch generation)",
    ),
    "allreduce.bandwidth": Constant(
        (1048576 - 512) / (33.8e-6 - 5.9e-6),
        "B/s",
        "measured: slope of the same sglang PR #2904 table, TP 8: (1 MiB - 512 B) / (0.0338 ms - 0.0059 ms) "
        "= 37.6 GB/s of message size (one-shot algorithm; far below the 450 GB/s per direction NVLink "
        "datasheet figure because one-shot moves (p-1) copies)",
    ),
    # --- Kernels (modelling choices) ---------------------------------------------------------------------
    "launch.per_kernel": Constant(
        2.0e-6,
        "s",
        "assumption: per-kernel launch/gap cost inside a CUDA graph; eager launches cost 4-6 us "
        "(susun-blog.com 'pegainfer (3)', on an RTX 5070 Ti), a graph replay less",
    ),
    "kernels.attention": Constant(
        5,
        "kernels",
        "assumption: TensorRT-LLM-style decode attention sub-block: RMSNorm, QKV GEMM, RoPE + KV-cache "
        "write, decode attention, o_proj GEMM (all-reduce counted apart; its launch is inside its latency)",
    ),
    "kernels.ffn": Constant(
        4,
        "kernels",
        "assumption: FFN sub-block: RMSNorm, gate+up GEMM, SwiGLU (+ FP8 quantize), down GEMM "
        "(the all-reduce is counted apart)",
    ),
    "kernels.head": Constant(
        4,
        "kernels",
        "assumption: embedding gather, final RMSNorm, lm_head GEMM, sampling (plus one all-gather)",
    ),
    "bytes.activation": Constant(
        2, "B/element", "assumption: bf16 activations between kernels and in the all-reduces"
    ),
    "bytes.kv_cache": Constant(
        1,
        "B/element",
        "assumption: FP8 KV cache alongside FP8 weights (at context 1024, batch 1 the KV read is <1% of the "
        "weight bytes, so this barely matters)",
    ),
    "efficiency.flops": Constant(
        0.7,
        "fraction of dense FP8 peak",
        "assumption: FP8 GEMMs reach about 70% of the dense peak when compute-bound; no GEMM is "
        "compute-bound at batch 1 (FP8 ridge point is ~590 FLOP/B at peak, a batch-1 GEMM does 2 FLOP/B)",
    ),
    # --- Calibration targets (paper, 8xH100, FP8, TP 8) ---------------------------------------------------
    "paper.llama405b.tokens_per_s": Constant(
        41.44, "tokens/s", "paper: arXiv 2503.18908, Llama-3.1-405B on 8xH100, FP8, TP 8 (calibration target)"
    ),
    "paper.ultra253b.before.tokens_per_s": Constant(
        63.38,
        "tokens/s",
        "paper: arXiv 2503.18908, pruned 253B before FFN Fusion on 8xH100, FP8, TP 8 (calibration target)",
    ),
    "paper.ultra253b.after.tokens_per_s": Constant(
        70.92,
        "tokens/s",
        "paper: arXiv 2503.18908, 253B after FFN Fusion on 8xH100, FP8, TP 8. NEVER used for calibration: "
        "it is what the model is checked against",
    ),
    "paper.ultra253b.speedup": Constant(
        1.12,
        "x",
        "paper: arXiv 2503.18908, 63.38 -> 70.92 tokens/s from fusion alone (not used for calibration)",
    ),
    "calibration.batch": Constant(
        1, "sequences", "assumption: the paper's tokens/s is per-user decode speed; taken at batch 1"
    ),
    "calibration.context": Constant(
        1024,
        "tokens",
        "assumption: the context length of the paper's latency runs was not taken from the paper; 1024 "
        "used (refitting at 8192 moves the fused 253B prediction by 0.4%)",
    ),
    # --- Calibrated (runtime.latency.fit.fit_overheads(); do not edit by hand)
    # ------------------------------
    "calibrated.bw_efficiency": Constant(
        0.7572704840,
        "fraction of HBM datasheet bandwidth",
        "calibrated on the paper's Llama-3.1-405B 41.44 and pre-fusion Ultra-253B 63.38 tokens/s "
        "(8xH100 FP8 TP8), jointly with calibrated.layer_overhead; applied to H200 unchanged",
    ),
    "calibrated.layer_overhead": Constant(
        1.7922393595e-06,
        "s per layer (block)",
        "calibrated on the paper's Llama-3.1-405B 41.44 and pre-fusion Ultra-253B 63.38 tokens/s "
        "(8xH100 FP8 TP8), jointly with calibrated.bw_efficiency; applied to H200 unchanged",
    ),
}


def value(name: str) -> float:
    return CONSTANTS[name].value
