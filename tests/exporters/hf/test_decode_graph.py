"""The --decode graph built with onnx-ir (exporters.hf.decode_graph), checked call by call.

A left-padded batch is prefilled, then decoded one token per call from the returned cache; every real
position's logits and every cache slot of a real token are compared with

- transformers' own model run with its own cache (Llama with llama3 rope and tied embeddings, Mistral with
  a sliding window and yarn, Qwen2 with q/k/v biases, a window on some layers and dynamic NTK, a Llama
  with attention dropped, the real SmolLM2): the independent reference;
- for Nemotron-NAS checkpoints, which transformers cannot load, exporters/decode.py's torch model run
  eagerly with the checkpoint's weights (runtime.prune.model.load_checkpoint): the model the --decode
  graph was traced from before it was built with onnx-ir.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from exporters.decode import present_names
from exporters.decode_spec import describe
from exporters.hf.checkpoint import export_hf
from exporters.hf.config import decode_spec, read_config
from exporters.hf.synthetic import write_all_kinds
from passes.error_measures import max_abs_relative_error
from passes.metadata import DECODE_METADATA_KEY
from runtime.prune.model import load_checkpoint
from tests.exporters.hf_fixtures import FAMILY_CASES, puzzle_models, save_llama_family

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-5  # relative to the largest value compared (measured: ~1e-7 to 1e-6)
VOCAB = 96
Steps = tuple[np.ndarray, dict[str, np.ndarray]]  # logits [batch, length, vocab], presents by name
PRUNED_DEMO = Path.home() / ".cache" / "ffn-fusion" / "demo" / "smollm2-pruned-remove6-runs2"

# every rope kind and attention variant the prefill graph covers, and dropped attention
HF_CASES = {
    **FAMILY_CASES,
    "llama_dropped_attention": ("LlamaForCausalLM", {"num_hidden_layers": 5, "drop_attention": (1, 2, 3)}),
}


def padded_batch(vocab: int, seed: int = 0, length: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Three rows, left-padded by 0, 3 and 6 tokens (pad id 0): ids and attention_mask [3, length]."""
    ids = np.random.default_rng(seed).integers(1, vocab, (3, length)).astype(np.int64)
    mask = np.ones_like(ids)
    for row, pad in enumerate((0, 3, 6)):
        mask[row, :pad], ids[row, :pad] = 0, 0
    return ids, mask


def calls(length: int, prefill: int) -> list[tuple[int, int]]:
    """[start, stop) of each call: the prefill, then one token per call."""
    return [(0, prefill), *((t, t + 1) for t in range(prefill, length))]


def graph_steps(path: Path, ids: np.ndarray, mask: np.ndarray, prefill: int) -> Steps:
    """Logits of every position [batch, length, vocab] and the last call's presents, from ONNX Runtime."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_")]
    outputs = [o.name for o in session.get_outputs()]
    cache = {i.name: np.zeros((len(ids), i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    parts = []
    for start, stop in calls(ids.shape[1], prefill):
        feeds = {"input_ids": ids[:, start:stop], "attention_mask": mask[:, :stop], **cache}
        out = dict(zip(outputs, session.run(None, feeds), strict=True))
        parts.append(out["logits"])
        cache = {n: out["present_" + n.removeprefix("past_")] for n in cache}
    presents = {"present_" + n.removeprefix("past_"): v for n, v in cache.items()}
    return np.concatenate(parts, axis=1), presents


def positions(mask: np.ndarray) -> np.ndarray:
    """cumsum(mask) - 1, 0 on padding: what the graph computes inside, fed to the references."""
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


@torch.no_grad()
def transformers_steps(folder: Path, ids: np.ndarray, mask: np.ndarray, prefill: int) -> Steps:
    """The same calls through transformers' model and its DynamicCache (a sliding-window layer's cache
    keeps only its last slots)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the transformers reference needs it)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    where, cache, parts = positions(mask), None, []
    for start, stop in calls(ids.shape[1], prefill):
        out = model(
            input_ids=torch.from_numpy(ids[:, start:stop]),
            attention_mask=torch.from_numpy(mask[:, :stop]),
            position_ids=torch.from_numpy(where[:, start:stop]),
            cache=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        parts.append(out.logits.numpy())
    presents = {}
    for index, layer in enumerate(cache.layers):
        presents[f"present_key_{index}"] = layer.keys.numpy()
        presents[f"present_value_{index}"] = layer.values.numpy()
    return np.concatenate(parts, axis=1), presents


@torch.no_grad()
def torch_decode_steps(folder: Path, ids: np.ndarray, mask: np.ndarray, prefill: int) -> Steps:
    """The same calls through exporters/decode.py's DecodeLlama holding the checkpoint's weights."""
    net = load_checkpoint(folder).net
    layers = net.cache_layers
    kv = [net.model.layers[i].self_attn.kv_heads for i in layers]
    dim = net.spec.resolved_head_dim
    past = [torch.zeros(len(ids), heads, 0, dim) for heads in kv for _ in range(2)]
    parts = []
    for start, stop in calls(ids.shape[1], prefill):
        logits, *past = net(torch.from_numpy(ids[:, start:stop]), torch.from_numpy(mask[:, :stop]), *past)
        parts.append(logits.numpy())
    names = [n for i in layers for n in present_names(i)]
    return np.concatenate(parts, axis=1), dict(zip(names, (p.numpy() for p in past), strict=True))


def assert_same(got: Steps, expected: Steps, mask: np.ndarray) -> None:
    """Logits of real positions, and each present's slots of real tokens (the last slots, where the
    reference's cache holds fewer), within TOLERANCE; the graph has a cache for attention layers only."""
    (logits, presents), (reference, reference_presents) = got, expected
    real = mask.astype(bool)
    assert logits.shape == reference.shape
    assert max_abs_relative_error(logits[real], reference[real]) <= TOLERANCE
    assert presents and set(presents) <= set(reference_presents)
    for name, present in presents.items():
        kept = reference_presents[name]
        n = kept.shape[2]
        slots = real[:, -n:]  # [batch, n]
        assert present.shape[:2] == kept.shape[:2] and present.shape[2] == mask.shape[1] >= n
        ours, theirs = present[:, :, -n:].transpose(0, 2, 1, 3), kept.transpose(0, 2, 1, 3)
        assert max_abs_relative_error(ours[slots], theirs[slots]) <= TOLERANCE, name


# ------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("case", list(HF_CASES))
def test_decode_calls_equal_transformers_with_its_cache(tmp_path: Path, case: str) -> None:
    architecture, overrides = HF_CASES[case]
    folder = save_llama_family(tmp_path / "ckpt", architecture, vocab_size=VOCAB, seed=1, **overrides)
    path = tmp_path / "decode" / "model.onnx"
    result = export_hf(folder, path, decode=True)
    if case == "llama_dropped_attention":
        assert result.cache_layers == [0, 4]
    ids, mask = padded_batch(VOCAB)
    assert_same(graph_steps(path, ids, mask, 7), transformers_steps(folder, ids, mask, 7), mask)


def test_sliding_window_shows_in_the_decode_calls(tmp_path: Path) -> None:
    """The window matters in these calls: transformers without it gives other logits (the comparison
    above would catch a graph that ignored it)."""
    architecture, overrides = HF_CASES["mistral_yarn_window"]
    folder = save_llama_family(tmp_path / "ckpt", architecture, vocab_size=VOCAB, seed=1, **overrides)
    path = tmp_path / "decode" / "model.onnx"
    export_hf(folder, path, decode=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    ids, mask = padded_batch(VOCAB)
    logits, _ = graph_steps(path, ids, mask, 7)
    unwindowed, _ = transformers_steps(folder, ids, mask, 7)
    assert max_abs_relative_error(logits[mask == 1], unwindowed[mask == 1]) > 1e-3


@pytest.mark.parametrize("checkpoint", ["puzzle", "all_kinds"])
def test_nemotron_decode_calls_equal_the_torch_decode_model(tmp_path_factory, tmp_path, checkpoint) -> None:
    """Every Nemotron-NAS layer kind (variable GQA, Linear and no-op attention and FFN, a layer with
    neither): logits and presents equal DecodeLlama's with the checkpoint's weights."""
    if checkpoint == "puzzle":
        folder = puzzle_models(tmp_path_factory.getbasetemp(), "ckpt")  # bf16 shards, llama3 rope
        path = puzzle_models(tmp_path_factory.getbasetemp(), "decode")
    else:
        folder = write_all_kinds(tmp_path / "ckpt")
        path = tmp_path / "decode" / "model.onnx"
        export_hf(folder, path, decode=True)
    ids, mask = padded_batch(VOCAB, seed=2)
    assert_same(graph_steps(path, ids, mask, 5), torch_decode_steps(folder, ids, mask, 5), mask)


def test_metadata_describes_the_caches(tmp_path_factory) -> None:
    """The exported graph's `ffn_fusion.decode` metadata lists its cached layers and their KV heads."""
    folder = puzzle_models(tmp_path_factory.getbasetemp(), "ckpt")
    spec = decode_spec(read_config(folder))
    proto = onnx.load(str(puzzle_models(tmp_path_factory.getbasetemp(), "decode")), load_external_data=False)
    metadata = json.loads({p.key: p.value for p in proto.metadata_props}[DECODE_METADATA_KEY])
    assert metadata == describe(spec)
    past = [i.name for i in proto.graph.input if i.name.startswith("past_key_")]
    assert [f"past_key_{k}" for k in metadata["cache_layers"]] == past


_IMPORTS = """
import runpy, sys
sys.argv = ["export_model.py", *sys.argv[1:]]
try:
    runpy.run_path("tools/export_model.py", run_name="__main__")
except SystemExit as exc:
    assert not exc.code, exc.code
print("torch:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
"""


def test_decode_export_imports_no_torch(tmp_path_factory, tmp_path: Path) -> None:
    """`export_model.py --hf DIR --decode` builds its graph without torch (it traced torch before)."""
    folder = puzzle_models(tmp_path_factory.getbasetemp(), "ckpt")
    out = tmp_path / "out" / "model.onnx"
    args = ["--hf", str(folder), "--decode", "-o", str(out)]
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTS, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "torch: []" in result.stdout, result.stdout
    assert out.is_file() and "decode graph: KV caches" in result.stdout


# ------------------------------------------------------------------------------------------ real models


def test_smollm2_decode_calls_equal_transformers(smollm2_hf: Path, smollm2_decode_onnx: Path) -> None:
    """The real SmolLM2-135M (attention dropped from 13-22, as the demo prunes it): the decode graph's
    prefill and cached steps equal transformers' on a padded batch."""
    ids, mask = padded_batch(49152, seed=3, length=10)
    steps = graph_steps(smollm2_decode_onnx, ids, mask, 6)
    assert_same(steps, transformers_steps(smollm2_hf, ids, mask, 6), mask)


@pytest.mark.slow  # a 129M-parameter checkpoint through ONNX Runtime and torch (~15 s)
@pytest.mark.skipif(not PRUNED_DEMO.is_dir(), reason="make demo's pruned checkpoint is not cached")
def test_pruned_demo_checkpoint_decode_calls_equal_the_torch_decode_model(tmp_path: Path) -> None:
    """make demo's pruned Nemotron-NAS SmolLM2 (attention removed from six layers)."""
    path = tmp_path / "decode" / "model.onnx"
    export_hf(PRUNED_DEMO, path, decode=True)
    ids, mask = padded_batch(49152, seed=4, length=10)
    assert_same(graph_steps(path, ids, mask, 6), torch_decode_steps(PRUNED_DEMO, ids, mask, 6), mask)
