"""export -> fuse -> heal -> engines -> serve on the tiny model: tools/heal.py heals the prefill graph, writes
its weights into the fused KV-cache decode graph (--weights-from), build_engines.py quantizes that graph to
FP8 and builds its TensorRT engine (TensorRT-RTX, sm89, ahead of time), and tools/serve.py serves it to
the openai client with the greedy tokens of the healed prefill graph."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import openai
import pytest

from passes.graph_inputs import Signature
from tests import decode_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import start_cli

SHAPES = ["--batch", "1,1,2", "--seq", "1,16,64", "--workspace-mb", "256"]
STEPS = 5


def greedy_by_rerun(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens as the argmax of a full re-run of a prefill graph at every step (no cache)."""
    session = ort.InferenceSession(str(model))
    signature = Signature.of(session)
    sequence = list(prompt)
    for _ in range(steps):
        feeds = signature.feeds(np.array([sequence]))
        sequence.append(int(session.run([signature.logits.name], feeds)[0][0, -1].argmax()))
    return sequence[len(prompt) :]


@pytest.fixture(scope="module")
def healed_folder(tmp_path_factory, tool):
    """(served folder with the healed decode graph as model.onnx, the healed prefill graph, the ids file)."""
    work = tmp_path_factory.mktemp("heal_deploy")
    ids = work / "ids.npy"
    np.save(ids, np.random.default_rng(1).integers(4, fx.tiny_spec().vocab, 2048))
    common = ["--calib", ids, "--heldout", ids, "--window", 64, "--eval-tokens", 0]
    prefill = work / "prefill.healed.onnx"
    models = {n: fx.decode_models(n) for n in ("prefill", "prefill_fused", "decode", "decode_fused")}
    tool("heal", models["prefill"], models["prefill_fused"], *common, "-o", prefill, check=True)
    folder = work / "served"
    folder.mkdir()
    tool("heal", models["decode"], models["decode_fused"], "--weights-from", prefill, *common,
         "-o", folder / "model.onnx", check=True)
    sf.save_tokenizer(folder, fx.tiny_spec().vocab)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": sf.EOS}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    return folder, prefill, ids


def test_fp8_engine_builds_from_the_healed_decode_graph(healed_folder, tmp_path, tool):
    folder, _, ids = healed_folder
    rows = tmp_path / "rows.npy"
    np.save(rows, np.load(ids)[:512].reshape(8, 64))  # build_engines takes [batch, seq] ids
    out = tmp_path / "engines"
    result = tool("build_engines", folder / "model.onnx", "--fp8", "--calib", rows, *SHAPES, "--out", out)
    assert result.returncode == 0, result.stderr
    side = json.loads((out / "model_fp8.engine.json").read_text())
    assert side["engine_bytes"] == (out / "model_fp8.engine").stat().st_size > 0
    assert [i["name"] for i in side["inputs"]][:2] == ["input_ids", "attention_mask"]


def test_serve_answers_with_the_healed_model(healed_folder):
    folder, prefill, _ = healed_folder
    prompt = sf.PROMPTS[0]
    expected = greedy_by_rerun(prefill, prompt, STEPS)
    process, url, _ = start_cli(str(folder), "--model-name", "healed", "--log-level", "warning")
    try:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = api.completions.create(model="healed", prompt=prompt, max_tokens=STEPS, temperature=0)
        assert reply.choices[0].text == sf.words(expected)
    finally:
        process.terminate()
        process.wait(timeout=30)
