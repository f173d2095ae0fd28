"""ONNX -> TensorRT engines: one engine per graph, through one shim for TensorRT-RTX and datacenter
TensorRT."""
