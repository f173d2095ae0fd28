"""Loading, atomic saving and streamed writing of ONNX models and their weights; ONNX Runtime sessions."""
