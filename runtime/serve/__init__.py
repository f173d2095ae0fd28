"""An OpenAI-compatible inference service over decode graphs, TensorRT engines and TP folders.

    served = loading.load("model_folder/")                   # graph + tokenizer + limits
    app = app.create_app(served, max_batch=8, max_queue=64)  # FastAPI app; run it with uvicorn

- loading.py: MODEL (ONNX file, export folder, engines folder, TP folder) -> ServedModel
- batch.py: running sequences as one left-padded KV-cache batch (continuous batching at step level,
  prefill batched per step and cut in chunks)
- scheduler.py: the worker thread's step loop with a token budget per step (chunked prefill, decode
  first), the scorer thread (prompt logprobs), bounded waiting queue, cancellation; per-request fault
  containment, fatal faults, abort
- tp_ranks.py: a TP folder served by one process per rank (gloo; NCCL on GPUs), as a batch.Runner
- sampling.py: greedy / temperature / top_k / top_p / min_p and vLLM's penalties, per-request seeded
- logprobs.py: token logprobs (log-softmax of the float32 logits) and the OpenAI logprobs formats
- protocol.py: request bodies, OpenAI error JSON, incremental text with stop strings
- responses.py: each choice's text, logprobs and finish reason as OpenAI bodies and stream chunks
- app.py: the HTTP routes (FastAPI + sse-starlette); openapi.py: the OpenAPI document (every bound stated);
  connections.py: what one client can hold (read deadlines, connection cap, body limit, lingering close);
  metrics.py: Prometheus metrics
- server.py: uvicorn around the app (tools/serve.py): drain on SIGTERM, exit 1 on a fatal fault;
  the serving benchmark is runtime/bench/serve.py
"""
