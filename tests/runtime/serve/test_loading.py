"""What `tools/serve.py MODEL` serves (runtime/serve/loading.py): how a file or folder resolves to a backend,
and real model folders (SmolLM2 as a bare ONNX file, Optimum's and ONNX Runtime GenAI's export folders)
served with their tokenizers: greedy text equals Hugging Face transformers'."""

from __future__ import annotations

import concurrent.futures as cf
import json

import openai
import pytest
import torch

from exporters.smollm2_tokenizer import load_tokenizer
from runtime.serve import loading
from runtime.serve.server import ServerThread
from tests import serve_fixtures as sf


def test_model_resolution(tmp_path_factory, tmp_path):
    folder = sf.tiny_folder(tmp_path_factory.getbasetemp())
    assert loading.resolve(folder) == loading.ModelSource("ort", folder / "model.onnx", folder)
    assert loading.resolve(folder / "model.onnx").backend == "ort"
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "model.engine").write_bytes(b"")
    profile = {
        "input_ids": {"min": [1, 1], "opt": [4, 64], "max": [4, 256]},
        "attention_mask": {"min": [1, 1], "opt": [4, 128], "max": [4, 1024]},
    }
    (engines / "model.engine.json").write_text(json.dumps({"profile": profile}))
    assert loading.resolve(engines) == loading.ModelSource("tensorrt", engines / "model.engine", engines)
    assert loading.engine_limits(engines / "model.engine") == loading.EngineLimits(4, 256, 1024)
    if not torch.cuda.is_available():  # TensorRT runs on GPUs only: one clear error, no traceback
        with pytest.raises(loading.UserError):
            loading.load(engines)
    (engines / "model_fp8.onnx").write_bytes(b"")
    assert loading.resolve(engines, "tensorrt").backend == "tensorrt"
    assert loading.resolve(engines, "ort").target == engines / "model_fp8.onnx"
    for target, backend, message in [
        (tmp_path / "none", "auto", "does not exist"),
        (folder, "tp", "tp.json"),
        (folder / "model.onnx", "tensorrt", "engine"),
        (tmp_path, "auto", "no model.onnx"),
    ]:
        with pytest.raises(loading.UserError, match=message):
            loading.resolve(target, backend)


@pytest.mark.slow
def test_smollm2_greedy_text_equals_transformers(smollm2_decode_onnx):
    """The pruned SmolLM2 decode graph served as a bare ONNX file (the GGUF tokenizer, found by vocabulary):
    greedy completions and chat replies equal transformers' greedy generation of the same model, alone,
    streamed, and among 8 concurrent clients."""
    from exporters import smollm2  # noqa: PLC0415 (imports transformers: only when this slow test runs)

    hf, tokenizer = smollm2.load_pruned(), load_tokenizer()
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
        "The quick brown fox",
        "import numpy as np",
        "Water boils at",
        "My favourite colour is",
    ]

    def reference(ids: list[int], steps: int) -> str:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id or 0,
            )
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    served = loading.load(smollm2_decode_onnx)
    with ServerThread(served) as smol:
        api = openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = served.id

        def run(prompt: str) -> str:
            return (
                api.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
                .choices[0]
                .text
            )

        alone = [run(p) for p in prompts]
        assert alone[:4] == [reference(list(tokenizer(p)["input_ids"]), 10) for p in prompts[:4]]
        with cf.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(run, prompts)) == alone
        chunks = api.completions.create(
            model=model, prompt=prompts[0], max_tokens=10, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks) == alone[0]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
        assert chat.choices[0].message.content == reference(ids, 12)
        assert chat.usage.prompt_tokens == len(ids)


@pytest.fixture(scope="module")
def corpus_reference(corpus_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (transformers: seconds to import; only for the corpus tests)

    model = AutoModelForCausalLM.from_pretrained(corpus_hf, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(corpus_hf)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["optimum", "optimum-nopast", "genai-fp32"])
def test_third_party_export_folders_serve_like_transformers(third_party_corpus, corpus_reference, entry):
    """Optimum's (with and without past) and ONNX Runtime GenAI's export folders of SmolLM2 (attention
    dropped from 13-22; tests/corpora/third_party.py), served as folders: greedy text equals transformers'
    greedy generation of the Hugging Face folder they came from, alone and among concurrent requests."""
    hf, tokenizer = corpus_reference
    served = loading.load(third_party_corpus[entry].parent)
    assert served.model.cached == (entry != "optimum-nopast")
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]

    def reference(prompt: str) -> str:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    with ServerThread(served) as other:
        api = openai.OpenAI(base_url=other.url + "/v1", api_key="none", max_retries=0, timeout=300)

        def run(prompt: str) -> str:
            reply = api.completions.create(model=served.id, prompt=prompt, max_tokens=8, temperature=0)
            return reply.choices[0].text

        alone = [run(p) for p in prompts]
        assert alone == [reference(p) for p in prompts]
        with cf.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(run, prompts)) == alone
