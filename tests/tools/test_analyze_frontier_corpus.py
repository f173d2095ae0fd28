"""tools/analyze.py --frontier on graphs the project did not write: the real SmolLM2-135M (attention dropped
from blocks 13-22) as Optimum, ONNX Runtime GenAI (fp32 and int4), the TorchScript exporter and torch dynamo
export it (tests/corpora), a static-dims copy (batch 1, 16 tokens, as exporters that trace one example
write it), and an every-kind Nemotron-NAS checkpoint exported by export_model.py --hf. Each gives a
frontier.json whose plans the model accepts, none on the frontier dominated, and a budget's plan.json that
fuse_onnx.py + evaluate.py reproduce."""

from __future__ import annotations

import json
from pathlib import Path

import onnx_ir as ir
import pytest

from exporters.hf.synthetic import write_all_kinds
from passes.io.model_io import load_model, save_model
from passes.model_map import find_blocks
from passes.plan import parse_plan, validate_plan
from runtime.frontier.moves import ffn_moves
from tests.tools.test_analyze_frontier import assert_frontier

KEYS = {"plan", "predicted_speedup", "kl", "ppl", "top1", "on_frontier"}
# SmolLM2 is 135M parameters: one step per walk, FFN pairs, a few tokens; parallel pairs where PAIRS is added.
SMALL = ["--screen-tokens", "16", "--eval-tokens", "32", "--max-group", "2", "--max-steps", "1", "--quiet"]
PAIRS, NO_PAIRS = ["--block-group", "2"], ["--block-group", "0"]
# Any plan these walks reach is within --max-kl 5 (the fastest is chosen: a parallel pair on SmolLM2);
# --min-speedup 1.01 chooses the lowest KL among the fusing plans (an FFN pair on SmolLM2).
FASTEST, CLOSEST = ["--max-kl", "5"], ["--min-speedup", "1.01"]
RUN = (13, 22)  # the corpus's attention-free run


def static_copy(source: Path, target: Path, batch: int, seq: int) -> Path:
    """`source` with input_ids' batch and sequence dims fixed in every value's shape, as an exporter that
    traces one example writes them."""
    model = load_model(source)
    ids = next(v for v in model.graph.inputs if v.name == "input_ids")
    fixed = dict(zip(map(str, ids.shape), (batch, seq), strict=True))
    for value in [*model.graph.inputs, *model.graph.outputs, *(o for n in model.graph for o in n.outputs)]:
        if value.shape is not None:
            value.shape = ir.Shape([d if isinstance(d, int) else fixed.get(str(d), d) for d in value.shape])
    save_model(model, target, external=True)
    return target


def check_frontier(model: Path, out: Path, budget: list) -> list[dict]:
    """frontier.json's entries: every plan valid for the model and measured once, the frontier's plans
    dominated by none, every other plan beaten on both axes, plan.json the budget's choice among the
    frontier's fusing plans (--max-kl X: the fastest within X; --min-speedup Y: the lowest KL at Y or
    faster)."""
    entries = json.loads((out / "frontier.json").read_text())
    assert entries and all(set(e) >= KEYS for e in entries)
    assert entries[0]["plan"] == {"groups": [], "norm": "last"} and entries[0]["kl"] == 0
    blocks = find_blocks(load_model(model))
    for e in entries:
        validate_plan(parse_plan(e["plan"]), blocks)  # a UserError fails the test
    plans = [json.dumps(e["plan"], sort_keys=True) for e in entries]
    assert len(set(plans)) == len(plans)
    front = assert_frontier(entries)
    chosen = json.loads((out / "plan.json").read_text())
    entry = next(e for e in entries if e["plan"] == chosen)
    fusing = [e for e in front if e["plan"]["groups"] or e["plan"].get("parallel_blocks")]
    kind, value = budget[0], float(budget[1])
    if kind == "--max-kl":
        assert entry["predicted_speedup"] == max(e["predicted_speedup"] for e in fusing if e["kl"] <= value)
    else:
        assert entry["kl"] == min(e["kl"] for e in fusing if e["predicted_speedup"] >= value)
    return entries


def reproduce(tool, model: Path, out: Path, folder: Path, tokens: int, window: int) -> dict:
    """The budget's plan fused by fuse_onnx.py (validated: each group against the float64 reference) and
    measured by evaluate.py: the table's numbers again."""
    entries = json.loads((out / "frontier.json").read_text())
    entry = next(e for e in entries if e["plan"] == json.loads((out / "plan.json").read_text()))
    fused = folder / "fused.onnx"
    run = tool("fuse_onnx", model, out / "plan.json", "-o", fused)
    assert run.returncode == 0, run.stderr
    run = tool("evaluate", model, fused, "--max-tokens", tokens, "--window", window, "--json", "--quiet")
    assert run.returncode == 0, run.stderr
    pooled = json.loads(run.stdout)["results"][-1]
    assert pooled["kl"] == pytest.approx(entry["kl"], rel=1e-6, abs=1e-9)
    assert pooled["ppl_fused"] == pytest.approx(entry["ppl"], rel=1e-6)
    assert pooled["top1_agreement"] == pytest.approx(entry["top1"])
    for p in folder.glob("fused.onnx*"):  # 500 MB each
        p.unlink()
    return entry


def inside_the_run(entries: list[dict]) -> None:
    """FFN groups only inside the attention-free run, parallel pairs only outside it."""
    for e in entries:
        assert all(RUN[0] <= i < j <= RUN[1] for i, j in e["plan"]["groups"]), e["plan"]
        assert all(j < RUN[0] or i > RUN[1] for i, j in e["plan"].get("parallel_blocks", [])), e["plan"]


@pytest.mark.slow  # 30-60 s CPU each: 18 or 36 move costs, 2-3 plans and a reproduction of a 135M model
@pytest.mark.parametrize(
    ("name", "budget", "pairs"),
    [("optimum", FASTEST, PAIRS), ("torchscript-17", CLOSEST, NO_PAIRS)],
    ids=["optimum", "torchscript-17"],
)
def test_frontier_on_a_third_party_export(tool, third_party_corpus, tmp_path, name, budget, pairs):
    """The Optimum and TorchScript exports (GenAI: the int4 test below; dynamo: the static-dims test; the
    fp32 exporters all give the same table, as they should for one model)."""
    model, out = third_party_corpus[name], tmp_path / "fr"
    run = tool("analyze", model, "--frontier", "--out", out, *budget, "--window", "16", *pairs, *SMALL)
    assert run.returncode == 0, run.stderr
    parallel = 18 if pairs == PAIRS else 0  # [0, 1] .. [11, 12] and [23, 24] .. [28, 29]
    assert f"moves: 18 FFN groups (norm last and fold), {parallel} parallel groups" in run.stdout
    entries = check_frontier(model, out, budget)
    inside_the_run(entries)
    assert {e["plan"]["norm"] for e in entries if e["plan"]["groups"]} == {"last", "fold"}
    reproduce(tool, model, out, tmp_path, 32, 16)


@pytest.mark.slow  # ~25 s CPU: as above, one norm mode
def test_int4_export_walks_only_the_norm_mode_it_can_fuse(tool, third_party_corpus, tmp_path):
    """GenAI's int4 MatMulNBits weights cannot take a folded norm: the "fold" moves are left out before any
    cost is screened (they used to be walked, then refused by the fusion, ending the run with exit 2)."""
    model, out = third_party_corpus["genai-int4"], tmp_path / "fr"
    run = tool("analyze", model, "--frontier", "--out", out, *CLOSEST, "--window", "16", *NO_PAIRS, *SMALL)
    assert run.returncode == 0, run.stderr
    assert "moves: 9 FFN groups (norm last), 0 parallel groups" in run.stdout
    assert 'left out: 9 FFN groups the fusion refuses (first: group [13, 14]: "fold" cannot' in run.stdout
    entries = check_frontier(model, out, CLOSEST)
    inside_the_run(entries)
    assert {e["plan"]["norm"] for e in entries if e["plan"]["groups"]} == {"last"}
    reproduce(tool, model, out, tmp_path, 32, 16)


@pytest.mark.slow  # ~30 s CPU
def test_static_dims_set_the_window_and_the_screen_batch(tool, third_party_corpus, tmp_path):
    """A graph with a fixed batch (1) and sequence length (16): the window comes from the graph (no
    --window), the move costs run one window at a time, and a --window it does not take is one error line
    (it used to be ONNX Runtime's internal error)."""
    (tmp_path / "static").mkdir()
    model = static_copy(third_party_corpus["dynamo-18"], tmp_path / "static" / "model.onnx", 1, 16)
    args = ["--frontier", *NO_PAIRS, *SMALL]
    refused = tool("analyze", model, "--out", tmp_path / "no", "--window", "32", *args)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "takes exactly 16 tokens per sequence" in refused.stderr and not (tmp_path / "no").exists()
    out = tmp_path / "fr"
    # 32 screen tokens: 2 windows, more than the batch; no parallel moves (the window is what is tested)
    run = tool("analyze", model, "--out", out, *CLOSEST, *args, "--screen-tokens", "32")
    assert run.returncode == 0, run.stderr
    assert "(2 x 16 tokens)" in run.stdout and "prose 32 tokens, code 32 tokens" in run.stdout
    entries = check_frontier(model, out, CLOSEST)
    inside_the_run(entries)
    reproduce(tool, model, out, tmp_path, 32, 16)


@pytest.fixture(scope="module")
def all_kinds(tool, tmp_path_factory) -> Path:
    """Every Nemotron-NAS layer kind (exporters/hf/synthetic.py ALL_KINDS_BLOCKS), exported as users do."""
    base = tmp_path_factory.mktemp("all_kinds")
    folder = write_all_kinds(base / "ckpt", seed=7, vocab=96)
    model = base / "onnx" / "model.onnx"
    tool("export_model", "--hf", folder, "--dtype", "float32", "-o", model, check=True)
    return model


def test_ffn_moves_skip_blocks_without_a_swiglu(all_kinds):
    """Runs 1-4 (layer 2 an identity: no FFN) and 9-10; layer 5 has attention and no FFN, 7 a Linear
    attention, 8 a Linear FFN. A group starts at a SwiGLU and holds two of them; from the attention block
    before a run only where it has a SwiGLU (0 before 1-4; not 8 before 9-10)."""
    blocks = find_blocks(load_model(all_kinds))
    assert [b.attention_kind for b in blocks][5:9] == ["attention", "attention", "linear", "none"]
    groups = sorted({m.group for m in ffn_moves(blocks)})
    assert groups == [(1, 3), (1, 4), (3, 4), (9, 10)]
    assert sorted({m.group for m in ffn_moves(blocks, start_at_attention=True)}) == [
        (0, 1), (0, 3), (0, 4), (1, 3), (1, 4), (3, 4), (9, 10)]


@pytest.mark.slow  # ~15 s
def test_frontier_on_every_nemotron_nas_kind(tool, all_kinds, tmp_path):
    """No parallel moves (no two consecutive blocks with softmax attention and a SwiGLU: layer 5 has no FFN,
    7's attention is a Linear), FFN groups across the identity layer, both norm modes; the budget's plan
    reproduced."""
    out = tmp_path / "fr"
    args = ["--screen-tokens", "48", "--window", "12", "--eval-tokens", "96", "--block-group", "2",
            "--start-at-attention", "--quiet"]
    run = tool("analyze", all_kinds, "--frontier", "--out", out, "--max-kl", "0.1", *args)
    assert run.returncode == 0, run.stderr
    assert "moves: 14 FFN groups (norm last and fold), 0 parallel groups" in run.stdout
    entries = check_frontier(all_kinds, out, ["--max-kl", "0.1"])
    groups = {tuple(g) for e in entries for g in e["plan"]["groups"]}
    assert groups <= {(0, 1), (0, 3), (0, 4), (1, 3), (1, 4), (3, 4), (9, 10)} and (9, 10) in groups
    assert any(i <= 2 <= j for i, j in groups)  # a group across the identity layer was measured
    assert not any(e["plan"].get("parallel_blocks") for e in entries)
    assert {e["plan"]["norm"] for e in entries if e["plan"]["groups"]} == {"last", "fold"}
    # 4 attention parts (3 softmax, 1 Linear) and 9 FFN parts (8 SwiGLU, 1 Linear) all-reduce; 10 steps.
    assert (entries[0]["allreduces"], entries[0]["steps"]) == (13, 10)
    reproduce(tool, all_kinds, out, tmp_path, 96, 12)
