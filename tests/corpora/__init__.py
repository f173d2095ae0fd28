"""Test corpora: real third-party exports of SmolLM2 (Optimum, ONNX Runtime GenAI, torch.onnx, ...)."""
