"""Hugging Face checkpoints (Llama, Nemotron-NAS) -> ONNX, streamed, without torch on the weight path."""
