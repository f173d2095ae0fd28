"""FFN Fusion's graph passes and the library every tool calls.

ONNX Runtime 1.29+ on Linux keeps a telemetry database under ~/.cache, written at every process start
and exit, and tries to upload it (these machines have no network). Its files are deleted at exit, which
on a file system that discards freed blocks synchronously waits behind the writeback a tool has just
queued (docs/scale.md). Off by default; a user who sets ORT_DISABLE_TELEMETRY keeps their setting. It
is set here, before anything imports onnxruntime: the setting is read once, when ONNX Runtime starts.
"""

import os

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
