"""FP8 quantization: Q/DQ insertion (QuantizeFP8), activation calibration, the opset raise."""
