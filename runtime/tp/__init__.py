"""Tensor-parallel ranks: ONNX Runtime ranks over gloo, TensorRT ranks over NCCL."""
