import passes  # noqa: F401  (ONNX Runtime telemetry off before anything imports it; passes/__init__.py)
