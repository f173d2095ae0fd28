"""llama.cpp itself on the GGUF files of exporters.nas.export.export_gguf (tests/exporters/nas/test_gguf.py
checks them against a Python forward of llama.cpp's deci graph; here the real one runs).

- Logits: llama-cpp-python (`make llama-cpp`; skipped without it) evaluates a prompt's token ids on the
  GGUF, all positions, against the float32 ONNX graph in ONNX Runtime: a tiny Llama with an
  attention-free run, unfused and fused; a Nemotron-NAS checkpoint of every block kind with Llama 3's
  vocabulary, unfused and fused. f32 within 1e-4 (max |difference| / max |logit|; measured 0.8-1.6e-6 with
  llama.cpp's KV cache in float32, 4e-4 to 1.3e-3 with its default f16 cache); q8_0 printed and bounded
  loosely (measured 3.5e-2 to 8.2e-2: llama.cpp also quantizes the activations to 8 bits for its q8_0
  products, and hidden 64 leaves two Q8_0 blocks per row).
- The converter: where llama.cpp's convert_hf_to_gguf.py accepts the checkpoint (DeciLM with Llama 3's
  vocabulary, no Linear FFN), it is run on the Nemotron-NAS folder that export_checkpoint writes for the
  same fused graph, and every tensor (type, shape, bytes) and every metadata value of our GGUF must equal
  its output, f32 and q8_0. It runs under the transformers it pins (4.57; the Optimum venv), skipped
  without it (tests/llama_cpp.converter_python).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import ALL_KINDS_BLOCKS, LLAMA3_ROPE, deci_block, nemotron_config, write_nemotron
from exporters.nas import export as nas_export
from passes.error_measures import max_abs_relative_error
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from tests import llama_cpp
from tests.exporters.hf.deci_reference import read_gguf  # the format read directly: 20x GGUFReader's speed
from tests.exporters.hf_fixtures import save_llama_family
from tests.exporters.nas.vocab_fixtures import write_llama3_tokenizer
from tests.run_graph import graph_logits

pytestmark = pytest.mark.slow  # a 128256-token vocabulary per model, llama.cpp and the converter per case
if not hasattr(nas_export, "export_gguf"):
    pytest.skip("exporters.nas.export.export_gguf is not written yet", allow_module_level=True)

needs_llama = pytest.mark.skipif(
    not llama_cpp.llama_cpp_available(), reason="llama-cpp-python is not installed: `make llama-cpp`"
)
LLAMA3_VOCAB = 128256
F32_BOUND = 1e-4
Q8_0_BOUND = 0.15  # reported (printed); see the module docstring
# A tiny Llama: layer 0 attention, 1-3 attention-free (attention dropped), 4 attention; fused: [1, 3].
LLAMA_PLAN = {"groups": [[1, 3]], "norm": "fold"}
# ALL_KINDS_BLOCKS fused: the run 1-4 (identity layer 2 inside) and the last run 9-10.
ALL_KINDS_PLAN = {"groups": [[1, 4], [9, 10]], "norm": "fold"}
# The kinds the converter maps as export_gguf does (no Linear FFN, no FFN-less layer): GQA 2 and 1,
# attention-free, Linear attention; fused [1, 2] (attention-free) and [4, 5] (a Linear attention's layer).
CONVERTER_BLOCKS = [deci_block(2, 1.0), deci_block("no_op", 1.0), deci_block("no_op", 2.0),
                    deci_block(1, 1.0), deci_block("linear", 1.0), deci_block("no_op", 1.0)]  # fmt: skip
CONVERTER_PLAN = {"groups": [[1, 2], [4, 5]], "norm": "fold"}


def _llama3_checkpoint(folder: Path, blocks: list[dict], seed: int) -> Path:
    config = nemotron_config(blocks, hidden=64, heads=4, vocab=LLAMA3_VOCAB, rope_scaling=LLAMA3_ROPE)
    config.update(bos_token_id=128000, eos_token_id=128001)
    write_nemotron(folder, config, shards=2, seed=seed)
    write_llama3_tokenizer(folder)
    return folder


def _models(base: Path, source: Path, plan: dict) -> dict[str, tuple[Path, Path]]:
    """{"unfused": (source, graph), "fused": (source, fused graph)}, float32 graphs."""
    onnx = base / "onnx" / "model.onnx"
    export_hf(source, onnx, dtype="float32")
    fused = fuse_file(onnx, parse_plan(plan), base / "fused" / "model.onnx").output
    return {"unfused": (source, onnx), "fused": (source, fused)}


@pytest.fixture(scope="module")
def llama_models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    base = tmp_path_factory.mktemp("gguf_llama")
    source = save_llama_family(base / "ckpt", "LlamaForCausalLM", num_hidden_layers=5, intermediate_size=256,
                               drop_attention=(1, 2, 3))  # fmt: skip
    return _models(base, source, LLAMA_PLAN)


@pytest.fixture(scope="module")
def all_kinds_models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    base = tmp_path_factory.mktemp("gguf_all_kinds_llama3")
    return _models(base, _llama3_checkpoint(base / "ckpt", ALL_KINDS_BLOCKS, seed=7), ALL_KINDS_PLAN)


def llama_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of `ids` (one sequence, no BOS added), float32. The KV cache in
    float32 (llama.cpp's default f16 cache alone moves f32 logits by 4e-4 to 1.3e-3 of the largest)."""
    from llama_cpp import GGML_TYPE_F32, Llama  # noqa: PLC0415 (`make llama-cpp` installs it; skipped without)

    model = Llama(model_path=str(gguf), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, n_threads=1,
                  type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False, verbose=False)  # fmt: skip
    try:
        model.eval(ids)
        return np.array(model.scores[: len(ids)], dtype=np.float32)
    finally:
        model.close()


@needs_llama
@pytest.mark.parametrize("form", ["unfused", "fused"])
@pytest.mark.parametrize("family", ["llama", "all_kinds"])
def test_llama_cpp_logits_equal_the_graphs(request, family, form, tmp_path) -> None:
    source, onnx = request.getfixturevalue(f"{family}_models")[form]
    vocab = LLAMA3_VOCAB if family == "all_kinds" else 128
    ids = np.random.default_rng(3).integers(0, vocab, size=12).astype(np.int64)
    reference = graph_logits(onnx, ids[None])[0]
    errors = {}
    for dtype in ("f32", "q8_0"):
        gguf = nas_export.export_gguf(onnx, source, tmp_path / f"{dtype}.gguf", dtype=dtype).output
        logits = llama_logits(gguf, ids.tolist())
        assert logits.shape == reference.shape
        errors[dtype] = max_abs_relative_error(logits, reference)
    print(f"llama.cpp on export_gguf, {family} {form}: f32 {errors['f32']:.1e}, q8_0 {errors['q8_0']:.1e}")
    assert errors["f32"] <= F32_BOUND
    assert errors["q8_0"] <= Q8_0_BOUND


@pytest.fixture(scope="module")
def converter_case(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(source checkpoint, fused graph, export_checkpoint's float32 Nemotron-NAS folder of that graph)."""
    python = llama_cpp.converter_python()
    if python is None:
        pytest.skip("the converter needs transformers 4.57 (its pin), the Optimum venv's: make optimum-venv")
    base = tmp_path_factory.mktemp("gguf_converter")
    source = _llama3_checkpoint(base / "ckpt", CONVERTER_BLOCKS, seed=5)
    _, fused = _models(base, source, CONVERTER_PLAN)["fused"]
    nas = base / "nas"
    nas_export.export_checkpoint(fused, source, nas, dtype="float32")
    return source, fused, nas


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_gguf_equals_the_converters_output(converter_case, dtype, tmp_path) -> None:
    source, fused, nas = converter_case
    result = nas_export.export_gguf(fused, source, tmp_path / "ours.gguf", dtype=dtype)
    assert result.notes == {} and result.source_layers == [[0], [1, 2], [3], [4, 5]]
    converted = llama_cpp.convert_hf(nas, tmp_path / "converter.gguf", dtype, llama_cpp.converter_python())
    (ours, our_tensors), (theirs, their_tensors) = read_gguf(result.output), read_gguf(converted)
    # general.name is the folder's: ours names the source checkpoint, the converter the folder it read
    different = {k: (v, theirs.get(k)) for k, v in ours.items() if k != "general.name" and theirs.get(k) != v}
    assert not different
    assert ours["general.architecture"] == "deci" and ours["tokenizer.ggml.pre"] == "llama-bpe"
    assert sorted(their_tensors) == sorted(our_tensors)
    for name, (kind, shape, data) in our_tensors.items():
        other = their_tensors[name]
        assert (kind, shape) == other[:2], name
        assert np.array_equal(data, other[2]), name


def test_converter_refuses_a_linear_ffn(tmp_path) -> None:
    """Why the comparison above leaves out the Linear FFN: the converter cannot map its tensor (llama.cpp's
    deci graph has no form for it; export_gguf writes it as a Linear-attention layer, test_gguf.py)."""
    python = llama_cpp.converter_python()
    if python is None:
        pytest.skip("the converter needs transformers 4.57 (its pin), the Optimum venv's: make optimum-venv")
    blocks = [deci_block(2, 1.0), deci_block("no_op", "linear")]
    source = _llama3_checkpoint(tmp_path / "ckpt", blocks, seed=1)
    with pytest.raises(subprocess.CalledProcessError) as refused:
        llama_cpp.convert_hf(source, tmp_path / "converter.gguf", "f32", python)
    assert "linear_mlp" in refused.value.stderr
