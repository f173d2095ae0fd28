"""Every stage on graphs that other exporters wrote (issue 9): the corpus of tests/corpora/fixtures.py,
SmolLM2 with
attention dropped from blocks 13-22, as Optimum (with and without past), ONNX Runtime GenAI (fp32, int4),
TorchScript (opset 17), the ONNX Runtime transformers optimizer and torch.onnx dynamo (opsets 18, 23)
wrote it. The tools run as users run them; fused logits are checked against the torch reference. Then the
deployment stages on the fused graphs: generate (greedy tokens against transformers and the torch parallel
sums), bench (original and fused side by side), FP8 + TensorRT-RTX engine (FP8 checked in ONNX Runtime;
one-line refusals where TensorRT cannot take the graph), and ONNX Runtime GenAI's own generator."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
import pytest

from exporters.tensorrt.build import onnx_sha256
from passes.error_measures import l2_relative_error
from passes.graph_inputs import Signature
from passes.io.data_files import data_file_names
from passes.io.model_io import load_model, save_model
from passes.io.sessions import open_session
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from runtime.deploy import with_side_inputs
from runtime.generate import DecodeModel, greedy_generate
from tests.conftest import ROOT, run_tool
from tests.corpora.fixtures import GROUPS, expected_attention, torch_logits
from tests.corpora.third_party import ENTRIES
from tests.run_graph import graph_logits

pytestmark = pytest.mark.slow
# Batch 1: torch.onnx's opset-23 export writes RotaryEmbedding with cos/sin caches of batch 1, and ONNX
# Runtime 1.32's kernel then refuses any other batch (a third-party limitation; dynamo-18 takes any batch).
IDS = np.random.default_rng(1).integers(0, 49152, size=(1, 13))
INT4 = "genai-int4"
BATCH_1_ONLY = ("dynamo-23",)


def modes(name: str) -> list[str]:
    # int4 MatMulNBits weights cannot take folded norm rows exactly: the fuse pass refuses "fold" there.
    return ["last"] if name == INT4 else ["last", "fold"]


@cache
def reference(hf: Path, mode: str | None) -> np.ndarray:
    return torch_logits(hf, IDS, GROUPS if mode else (), mode or "last")


@pytest.fixture(scope="module")
def fused(tmp_path_factory, third_party_corpus, tool):
    """fused(name, mode): the entry fused with GROUPS by tools/fuse_onnx.py (validation on), once."""
    done: dict[tuple[str, str], tuple[Path, str]] = {}

    def get(name: str, mode: str) -> tuple[Path, str]:
        if (name, mode) not in done:
            folder = tmp_path_factory.mktemp(f"{name}-{mode}")
            plan = folder / "plan.json"
            plan.write_text(json.dumps({"groups": [list(g) for g in GROUPS], "norm": mode}))
            out = folder / "model.fused.onnx"
            result = tool("fuse_onnx", third_party_corpus[name], plan, "-o", out, check=True)
            done[name, mode] = (out, result.stdout)
        return done[name, mode]

    return get


@pytest.mark.parametrize("name", ENTRIES)
def test_show_blocks(tool, third_party_corpus, name):
    result = tool("fuse_onnx", third_party_corpus[name], "--show-blocks", "--json", check=True)
    rows = json.loads(result.stdout)["blocks"]
    assert [r["attention"] for r in rows] == expected_attention()
    assert {r["ffn_width"] for r in rows} == {1536}
    table = tool("fuse_onnx", third_party_corpus[name], "--show-blocks", check=True).stdout
    assert "attention-free runs: 13-22 (10 blocks)" in table


@pytest.mark.parametrize("name", ENTRIES)
def test_unfused_entry_is_the_torch_model(third_party_corpus, corpus_hf, name):
    """The corpus itself is right: each export (attention dropped) computes the HF folder's logits."""
    bound = 0.3 if name == INT4 else 1e-4  # int4 weights: quantization error, not a bug
    assert l2_relative_error(graph_logits(third_party_corpus[name], IDS), reference(corpus_hf, None)) < bound


@pytest.mark.parametrize("name,mode", [(n, m) for n in ENTRIES for m in modes(n)])
def test_fuse_validates_and_matches_torch(fused, third_party_corpus, corpus_hf, name, mode):
    path, stdout = fused(name, mode)
    assert "blocks: 30 -> 23" in stdout
    checks = [line for line in stdout.splitlines() if "vs parallel-sum reference" in line]
    assert len(checks) == 2 and all(line.endswith("ok") for line in checks), stdout
    logits = graph_logits(path, IDS)
    if name == INT4:  # the torch reference has the fp32 weights; int4 is exact against its own (validation)
        assert l2_relative_error(logits, graph_logits(third_party_corpus[name], IDS)) < 0.5
        return
    assert l2_relative_error(logits, reference(corpus_hf, mode)) < 1e-4
    assert l2_relative_error(logits, reference(corpus_hf, None)) > 1e-3  # fusion changed the function


def test_int4_refuses_fold_in_one_line(tool, third_party_corpus, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"groups": [list(g) for g in GROUPS], "norm": "fold"}))
    result = tool("fuse_onnx", third_party_corpus[INT4], plan, "-o", tmp_path / "f.onnx")
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]  # after the progress lines: one error line, no traceback
    assert last.startswith("error: ") and '"fold" cannot fold' in last and "Traceback" not in result.stderr
    assert not (tmp_path / "f.onnx").exists()


@pytest.mark.parametrize("name", ENTRIES)
def test_verify(tool, fused, third_party_corpus, name):
    path, _ = fused(name, modes(name)[-1])
    result = tool("fuse_onnx", "--verify", third_party_corpus[name], path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("verified")


def test_fused_weights_in_several_data_files(tool, fused, third_party_corpus, tmp_path):
    """--max-data-file-gb: ONNX Runtime GenAI's export fused with its weights in numbered files of at most
    100 MB, all written at once. The model computes exactly what the one-file output computes, and
    --verify reads it."""
    name = "genai-fp32"
    one_file, _ = fused(name, "fold")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"groups": [list(g) for g in GROUPS], "norm": "fold"}))
    out = tmp_path / "model.fused.onnx"
    tool("fuse_onnx", third_party_corpus[name], plan, "-o", out, "--max-data-file-gb", "0.1", check=True)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model.fused.onnx."))
    assert len(names) > 4 and names == data_file_names(out.name, len(names)), names
    np.testing.assert_array_equal(graph_logits(out, IDS), graph_logits(one_file, IDS))
    result = tool("fuse_onnx", "--verify", third_party_corpus[name], out)
    assert result.returncode == 0 and result.stdout.strip().endswith("verified"), result.stderr


@pytest.mark.parametrize("name", ENTRIES)
def test_evaluate(tool, fused, third_party_corpus, name):
    path, _ = fused(name, "last")
    batch = "1" if name in BATCH_1_ONLY else "4"
    result = tool("evaluate", third_party_corpus[name], path, "--max-tokens", "128", "--window", "32",
                  "--batch", batch, "--quiet", "--json", check=True)
    rows = {r["name"]: r for r in json.loads(result.stdout)["results"]}
    # The plan fuses 9 of the 10 attention-free blocks of a model never healed: agreement ~0.45 (int4 ~0.40).
    assert rows["all"]["tokens"] > 0 and 0.3 < rows["all"]["top1_agreement"] <= 1.0
    assert np.isfinite(rows["all"]["ppl_original"]) and np.isfinite(rows["all"]["ppl_fused"])


@pytest.mark.parametrize("name", ENTRIES)
def test_analyze(tool, third_party_corpus, name, tmp_path):
    result = tool("analyze", third_party_corpus[name], "--out", tmp_path, "--num-tokens", "32", "--window",
                  "32", "--quiet", "--norm", "last")
    assert result.returncode == 0, result.stderr
    analysis = json.loads((tmp_path / "analysis.json").read_text())
    assert len(analysis["blocks"]) == 30
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert all(13 <= i < j <= 22 for i, j in plan["groups"])


# ------------------------------------------------------------------------ generate, bench, FP8 + engine

PROMPT = "The capital of France is"
NEW_TOKENS = 4
# (max logits relative error, min cosine), FP8 against the fused fp32 model: test_fp8_smollm2.py's bounds
FP8_BOUNDS = (0.15, 0.99)
# TensorRT cannot take these; build_engines refuses them in one line before calibrating: int4 MatMulNBits
# (FP8 needs float weights), GenAI's GroupQueryAttention (TensorRT-RTX has no importer for the contrib op),
# torch's opset-23 RotaryEmbedding (its batch-1 cos/sin caches must match the input's dynamic batch).
FP8_REFUSED = {
    INT4: "holds int4 MatMulNBits weights",
    "genai-fp32": "failed to load GroupQueryAttention plugin",
    "dynamo-23": "cosCache has batch size 1 but must have the same batch size as input",
}
FP8_BUILT = [n for n in ENTRIES if n not in FP8_REFUSED]


def tool_main(name: str):
    """tools/<name>.py's main, run in this process (saves an interpreter and its imports per call)."""
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@cache
def hf_tokenizer(hf: Path):
    from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: seconds to import; only these tests need it)

    return AutoTokenizer.from_pretrained(hf)


@cache
def torch_greedy(hf: Path, prompt: tuple[int, ...], fused: bool) -> list[int]:
    """Greedy tokens of the folder's model: transformers' generate; fused, GROUPS' parallel sums in torch
    (tests/torch_reference.py) recomputed over the whole sequence each step."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only the torch reference needs it)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the torch reference needs it)

    from tests.torch_reference import parallel_model  # noqa: PLC0415 (imports torch: only the torch reference needs it)

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if not fused:
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
            return out[0, len(prompt) :].tolist()
        parallel_model(model, GROUPS, "last")
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def teacher_forced(path: Path, prompt: list[int], tokens: list[int]) -> list[int]:
    """The argmax at each generated position of one whole-sequence run of the graph (no cache)."""
    logits = graph_logits(path, np.array([prompt + tokens[:-1]]))
    return logits[0, len(prompt) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("name", ENTRIES)
def test_generate(fused, third_party_corpus, corpus_hf, monkeypatch, capsys, name):
    """runtime/generate.py on the export (its KV cache, or the whole sequence again each step) gives
    transformers' greedy tokens; tools/generate.py on the fused graph gives the torch parallel sums'."""
    tokenizer = hf_tokenizer(corpus_hf)
    prompt = list(tokenizer(PROMPT)["input_ids"])
    original = greedy_generate(DecodeModel.open(third_party_corpus[name]), [prompt], NEW_TOKENS).tokens[0]
    if name == INT4:  # int4 weights: its own whole-sequence argmax is the reference
        assert original == teacher_forced(third_party_corpus[name], prompt, original)
    else:
        assert original == torch_greedy(corpus_hf, tuple(prompt), False)
    path, _ = fused(name, "last")
    # the SmolLM2 tokenizer from the corpus' HF folder: the same vocabulary, without parsing the GGUF again
    monkeypatch.setattr("exporters.smollm2_tokenizer.load_tokenizer", lambda: tokenizer)
    args = [str(path), "--prompt", PROMPT, "--raw", "--max-new-tokens", str(NEW_TOKENS), "--stats"]
    assert tool_main("generate")(args) == 0
    out, err = capsys.readouterr()
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["new_tokens"] == NEW_TOKENS and stats["prompt_len"] == len(prompt)
    if name == INT4:
        tokens = greedy_generate(DecodeModel.open(path), [prompt], NEW_TOKENS).tokens[0]
        assert tokens == teacher_forced(path, prompt, tokens)
    else:
        tokens = torch_greedy(corpus_hf, tuple(prompt), True)
        assert tokens != original  # fusion changed the function
    assert out == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"


def test_genai_runtime_runs_the_genai_folders(fused, third_party_corpus, corpus_hf, tmp_path):
    """ONNX Runtime GenAI's own generator on the GenAI fp32 folder (KV caches only for the 20 layers with
    attention, at non-sequential indices) and on the fused graph in a copy of that folder."""
    prompt = list(hf_tokenizer(corpus_hf)(PROMPT)["input_ids"])

    def generate(folder: Path) -> list[int]:
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + NEW_TOKENS, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([prompt])
        tokens = []
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens

    source = third_party_corpus["genai-fp32"].parent
    assert generate(source) == torch_greedy(corpus_hf, tuple(prompt), False)
    path, _ = fused("genai-fp32", "last")
    folder = tmp_path / "fused"  # the GenAI folder with the fused graph in place of model.onnx
    folder.mkdir()
    for item in [*source.glob("tokenizer*.json"), path, path.with_name(path.name + ".data")]:
        (folder / item.name).symlink_to(item)
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = path.name
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert generate(folder) == torch_greedy(corpus_hf, tuple(prompt), True)


@pytest.mark.parametrize("name", ENTRIES)
def test_bench(fused, third_party_corpus, tmp_path, name):
    """tools/bench.py decode, original and fused side by side, tiny settings: the report is well formed."""
    path, _ = fused(name, "last")
    args = ["decode", "--original", third_party_corpus[name], "--fused", path, "--batch", 1,
            "--prompt-len", 8, "--gen-len", 3, "--reps", 1, "--warmup", 0, "--quiet", "--out", tmp_path]
    assert tool_main("bench")([str(a) for a in args]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["format"] == "ffn-fusion-bench/1" and data["gen_len"] == 3 and data["reps"] == 1
    assert [r["model"] for r in data["results"]] == ["original", "fused"]
    for row in data["results"]:
        assert row["batch"] == 1 and row["prompt_len"] == 8 and len(row["ttft_ms_all"]) == 1
        assert row["ttft_ms"] > 0 and row["decode_tokens_per_s"] > 0 and 0 <= row["token_agreement"] <= 1
    models = data["models"]
    assert (models["original"]["blocks"], models["fused"]["blocks"]) == (30, 23)
    # one all-reduce per attention (20) and per FFN sub-block: fusing 9 FFNs into 2 saves 7
    assert (models["original"]["allreduces_per_token"], models["fused"]["allreduces_per_token"]) == (50, 43)
    (speedup,) = data["speedup"]
    assert speedup["decode_tokens_per_s"] > 0 and (tmp_path / "bench.md").read_text().strip()
    assert (tmp_path / "bench.png").stat().st_size > 0


@cache
def text_ids(hf: Path) -> np.ndarray:
    """Real text as one row of token ids (dynamo-23's RotaryEmbedding takes batch 1 only)."""
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    return np.array(hf_tokenizer(hf)(text)["input_ids"][:256], dtype=np.int64)[None]


def calibration_ids(hf: Path, folder: Path) -> Path:
    """The first 96 tokens of the text, for --calib."""
    path = folder / "calib.npy"
    np.save(path, text_ids(hf)[:, :96])
    return path


def fp8_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """Logits in ONNX Runtime with the FP8-safe optimizer set (passes/io/sessions.py)."""
    session = open_session(path)
    return session.run([Signature.of(path).logits.name], Signature.of(path).feeds(ids))[0]


def assert_fp8_close(fp8: Path, fp32: Path, hf: Path) -> None:
    """On held-out text (tokens 200-231; random ids land outside the calibrated ranges: 0.146 on GenAI)."""
    held_out = text_ids(hf)[:, 200:232]
    got, reference = fp8_logits(fp8, held_out), fp8_logits(fp32, held_out)
    error = l2_relative_error(got, reference)
    cosine = float(got.ravel() @ reference.ravel() / (np.linalg.norm(got) * np.linalg.norm(reference)))
    assert 0 < error < FP8_BOUNDS[0] and cosine > FP8_BOUNDS[1], (error, cosine)


@pytest.fixture(scope="module")
def fp8_builds(fused, corpus_hf, tmp_path_factory):
    """tools/build_engines.py --fp8 on every fused entry TensorRT takes, one engine each with a small
    profile, two builds at a time (the builder works on one core; CI has two)."""
    folder = tmp_path_factory.mktemp("fp8")
    calib = calibration_ids(corpus_hf, folder)
    paths = {name: fused(name, "last")[0] for name in FP8_BUILT}

    def build(name: str):
        out = folder / name
        result = run_tool("build_engines", paths[name], "--fp8", "--calib", calib, "--batch", "1,1,1",
                          "--seq", "1,16,32", "--workspace-mb", "256", "--out", out)
        return result, out

    with ThreadPoolExecutor(2) as pool:
        jobs = {name: pool.submit(build, name) for name in FP8_BUILT}
        yield jobs


@pytest.mark.parametrize("name", FP8_BUILT)
def test_fp8_and_engine(fp8_builds, fused, corpus_hf, name):
    result, out = fp8_builds[name].result()
    assert result.returncode == 0, result.stderr
    stem = f"{fused(name, 'last')[0].stem}_fp8"  # build_engines names its outputs after the input
    fp8, engine = out / f"{stem}.onnx", out / f"{stem}.engine"
    sidecar = json.loads((out / f"{stem}.engine.json").read_text())
    assert sidecar["compute_capability"] == "sm89" and sidecar["onnx_sha256"] == onnx_sha256(fp8)
    assert engine.stat().st_size == sidecar["engine_bytes"] > 0
    assert_fp8_close(fp8, fused(name, "last")[0], corpus_hf)


@pytest.mark.parametrize("name", sorted(FP8_REFUSED))
def test_fp8_engine_refused_in_one_line(tool, fused, corpus_hf, tmp_path, name):
    path, _ = fused(name, "last")
    out = tmp_path / "out"
    result = tool("build_engines", path, "--fp8", "--out", out)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and FP8_REFUSED[name] in last and "Traceback" not in result.stderr
    assert not out.exists() or not any(out.iterdir())  # refused before calibrating: nothing written
    assert all(line.startswith("[build_engines] ") for line in result.stderr.strip().splitlines()[:-1])
    if name != INT4:  # FP8 itself works there (in ONNX Runtime); only TensorRT cannot take the graph
        batches = with_side_inputs([np.load(calibration_ids(corpus_hf, tmp_path))], path)
        scales = calibrate(path, batches, progress=False)
        model = load_model(path)
        quantize_fp8(model, scales)
        save_model(model, tmp_path / "fp8.onnx", external=True)
        assert_fp8_close(tmp_path / "fp8.onnx", path, corpus_hf)
