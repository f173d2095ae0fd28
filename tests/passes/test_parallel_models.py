"""Full-block parallelization (passes/parallel.py) on the real SmolLM2-135M and on third-party exports: two
4-block parallel groups validate against the block-by-block reference of the original, and the logits equal
an independent torch implementation of the formula (tests/torch_reference.py) within 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from exporters.hf.checkpoint import export_hf
from passes.error_measures import l2_relative_error, max_abs_relative_error
from passes.graph_inputs import Signature
from passes.io.model_io import load_model, save_model
from passes.io.sessions import open_session
from passes.model_map import build_model_map, walk_stream
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from passes.shard import count_allreduces
from tests.passes.shard.test_parallel_groups import _over_gloo
from tests.run_graph import graph_logits
from tests.torch_reference import parallel_blocks_model

pytestmark = pytest.mark.slow
IDS = np.random.default_rng(3).integers(0, 49152, size=(1, 11))
# The project export of SmolLM2, attention dropped from 13-22 (tests/conftest.py): full blocks 0-12, 23-29.
SMOLLM2_GROUPS = [[4, 7], [23, 26]]
# The corpus has attention dropped from blocks 13-22 (tests/corpora): full blocks are 0-12 and 23-29.
CORPUS_GROUPS = [[2, 5], [24, 27]]
# Optimum (with and without past) and GenAI fp32 (a SkipSimplifiedLayerNormalization residual chain).
CORPUS_ENTRIES = [
    "optimum", "optimum-nopast", "genai-fp32", "torchscript-17", "dynamo-18", "ort-optimizer", "dynamo-23"
]


def torch_logits(model: torch.nn.Module, groups) -> np.ndarray:
    parallel_blocks_model(model, groups)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(IDS), use_cache=False).logits.numpy()


def check(report, groups, out: Path) -> None:
    assert report.ok and [list(g.group) for g in report.groups] == groups
    assert all(g.kind == "parallel" and g.rel_error <= 1e-5 for g in report.groups)
    assert report.logits_rel_error is not None and report.logits_cosine is not None
    # The model map reads the parallelized graph: every block still there, each group's members marked.
    model_map = build_model_map(load_model(out))
    assert len(model_map.blocks) == 30 and len(model_map.parallel) == len(groups)
    members = {b.index: b.parallel for b in model_map.blocks if b.parallel is not None}
    assert members == {k: tuple(g) for g in groups for k in range(g[0], g[1] + 1)}
    assert [p.size for p in model_map.parallel] == [j - i + 1 for i, j in groups]


def test_smollm2_two_parallel_groups_equal_torch(smollm2_pruned_onnx, tmp_path) -> None:
    from exporters import smollm2  # noqa: PLC0415 (imports transformers: only the SmolLM2 reference needs it)

    out = tmp_path / "smollm2.parallel.onnx"
    report = fuse_file(smollm2_pruned_onnx, parse_plan({"parallel_blocks": SMOLLM2_GROUPS}), out).report
    check(report, SMOLLM2_GROUPS, out)
    print("\n".join(report.lines()))
    reference = torch_logits(smollm2.load_pruned(range(13, 23)), SMOLLM2_GROUPS)
    assert l2_relative_error(graph_logits(out, IDS), reference) < 1e-4


@pytest.mark.parametrize("name", CORPUS_ENTRIES)
def test_third_party_parallel_groups_equal_torch(third_party_corpus, corpus_hf, tmp_path, name) -> None:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the corpus references need it)

    out = tmp_path / "model.parallel.onnx"
    plan = parse_plan(json.loads(json.dumps({"groups": [], "parallel_blocks": CORPUS_GROUPS})))
    report = fuse_file(third_party_corpus[name], plan, out).report
    check(report, CORPUS_GROUPS, out)
    model = AutoModelForCausalLM.from_pretrained(corpus_hf, dtype=torch.float32).eval()
    assert l2_relative_error(graph_logits(out, IDS), torch_logits(model, CORPUS_GROUPS)) < 1e-4
    if name == "optimum":
        check_fp8(out, tmp_path / "fp8.onnx")


def check_fp8(parallel: Path, out: Path) -> None:
    """FP8 Q/DQ of a parallelized third-party graph: the groups survive (the stream walk, which the sharder
    uses, reads them with Q/DQ FFN branches) and the logits stay close to the fp32 parallel graph."""
    feeds = Signature.of(onnx.load(str(parallel), load_external_data=False)).feeds(IDS)
    scales = calibrate(parallel, [feeds], progress=False)
    model = load_model(parallel)
    report = quantize_fp8(model, scales)
    assert report.weights > 0
    save_model(model, out, external=True)
    assert [g.size for g in walk_stream(load_model(out)).parallel] == [4, 4]
    fp8, fp32 = graph_logits(out, IDS), graph_logits(parallel, IDS)
    assert 1e-4 < l2_relative_error(fp8, fp32) < 0.25  # it ran in FP8, close to the fp32 parallel graph


def test_genai_int4_parallel_groups_validate(third_party_corpus, tmp_path) -> None:
    """GenAI's int4 (MatMulNBits accuracy_level 4, GatherBlockQuantized): each group equals the original
    blocks run alone within 1e-5 when both sides compute on float activations (the validation's note), and
    the written graph keeps the int4 kernels at their level."""
    out = tmp_path / "model.parallel.onnx"
    plan = parse_plan({"groups": [], "parallel_blocks": CORPUS_GROUPS})
    report = fuse_file(third_party_corpus["genai-int4"], plan, out).report
    check(report, CORPUS_GROUPS, out)
    assert any("float activations" in note for note in report.notes)
    nbits = [n for n in load_model(out).graph if n.op_type == "MatMulNBits"]
    assert {n.attributes["accuracy_level"].as_int() for n in nbits} == {4}


def test_hf_exporter_and_optimum_all_reduces_and_tp2(third_party_corpus, corpus_hf, tmp_path) -> None:
    """The corpus' Hugging Face folder exported by this project's --hf exporter gives transformers' parallel
    logits too (1e-4; Optimum's export: test_third_party_parallel_groups_equal_torch); both exports go from
    50 to 38 all-reduces (20 attention + 30 FFN; two 4-block groups of full blocks: 8 -> 2 each), and
    Optimum's parallel graph in TP 2 ranks over gloo equals its one-device run (1e-5)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the corpus references need it)

    sources = {"hf": tmp_path / "hf_export" / "model.onnx", "optimum": third_party_corpus["optimum"]}
    export_hf(corpus_hf, sources["hf"], dtype="float32")
    plan = parse_plan({"parallel_blocks": CORPUS_GROUPS})
    for name, source in sources.items():
        out = tmp_path / f"{name}.parallel.onnx"
        check(fuse_file(source, plan, out).report, CORPUS_GROUPS, out)
        assert (count_allreduces(source), count_allreduces(out)) == (50, 38), name
    model = AutoModelForCausalLM.from_pretrained(corpus_hf, dtype=torch.float32).eval()
    got = graph_logits(tmp_path / "hf.parallel.onnx", IDS)
    assert l2_relative_error(got, torch_logits(model, CORPUS_GROUPS)) < 1e-4
    ids = IDS[:, :9]
    optimum = tmp_path / "optimum.parallel.onnx"
    (tmp_path / "tp").mkdir()
    got = _over_gloo({"optimum": optimum}, tmp_path / "tp", ids)["optimum"]
    assert max_abs_relative_error(got, _one_device(optimum, ids)) <= 1e-5


def _one_device(path: Path, ids: np.ndarray) -> np.ndarray:
    proto = onnx.load(str(path), load_external_data=False)
    signature = Signature.of(proto)
    return open_session(proto, folder=path.parent).run([signature.logits.name], signature.feeds(ids))[0]
