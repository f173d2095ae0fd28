"""ONNX -> Nemotron-NAS (DeciLM) Hugging Face checkpoint: a fused or healed graph written back as the folder
vLLM and TensorRT-LLM load (docs/deploy.md). Entry: exporters.nas.export.export_checkpoint."""
