"""FP8 quantization: Q/DQ insertion (QuantizeFP8), activation calibration, the opset raise, and its undoing
(dequantize.py: an FP8 graph back to a float graph of its FP8 weights)."""
