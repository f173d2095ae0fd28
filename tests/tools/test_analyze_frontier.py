"""tools/analyze.py --frontier as users run it, on a tiny project export with an attention-free run and full
blocks: frontier.json's plans, none dominated, the budget's plan.json reproduced from the command line by
fuse_onnx.py + evaluate.py, a second run served from the cache, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporters.spec import BlockSpec, ModelSpec
from tests import serve_fixtures as sf
from tests.artifacts import spec_export

FAST = ["--screen-tokens", "48", "--window", "12", "--eval-tokens", "96", "--block-group", "2", "--quiet"]
KEYS = {"plan", "predicted_speedup", "kl", "ppl", "top1", "on_frontier"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """Full blocks 0-2 (parallel candidates), an attention-free run 4-6 after attention block 3, block 7."""
    blocks = [BlockSpec(True, 48)] * 4 + [BlockSpec(False, 40), BlockSpec(False, 56), BlockSpec(False, 32)]
    spec = ModelSpec(hidden=32, heads=4, kv_heads=2, vocab=96, tie_embeddings=False,
                     blocks=[*blocks, BlockSpec(True, 48)])
    path = tmp_path_factory.mktemp("frontier") / "m.onnx"
    spec_export(spec, path, seed=5)
    return path


@pytest.fixture(scope="module")
def frontier(tool, model, tmp_path_factory):
    out = tmp_path_factory.mktemp("fr") / "out"
    run = tool("analyze", model, "--frontier", "--out", out, "--max-kl", "0.05", "--target-tp", "2", *FAST)
    assert run.returncode == 0, run.stderr
    return out, run


def test_frontier_lists_measured_plans_none_dominated(frontier):
    out, run = frontier
    entries = json.loads((out / "frontier.json").read_text())
    assert all(set(e) >= KEYS for e in entries)
    plans = [e["plan"] for e in entries]
    assert plans[0] == {"groups": [], "norm": "last"}
    assert any(p["groups"] == [[4, 6]] for p in plans)  # the run fused whole, its final FFN in
    assert {p["norm"] for p in plans if p["groups"]} == {"last", "fold"}  # one walk per norm mode
    assert any(p.get("parallel_blocks") for p in plans)  # whole-block moves are on the walks too
    assert len({json.dumps(p, sort_keys=True) for p in plans}) == len(plans)
    assert_frontier(entries)
    assert "summing the moves' costs" in run.stdout
    assert (out / "frontier.png").stat().st_size > 10_000
    table = (out / "frontier.md").read_text()
    assert "| plan | groups | norm | all-reduces | steps | pred. speedup |" in table


def test_the_budgets_plan_reproduces_from_the_command_line(tool, model, frontier, tmp_path):
    out, _ = frontier
    entries = json.loads((out / "frontier.json").read_text())
    chosen = json.loads((out / "plan.json").read_text())
    entry = next(e for e in entries if e["plan"] == chosen)
    fusing = [e for e in entries if e["plan"]["groups"] or e["plan"].get("parallel_blocks")]
    within = [e for e in fusing if e["on_frontier"] and e["kl"] <= 0.05]
    assert entry["predicted_speedup"] == max(e["predicted_speedup"] for e in within)
    fused = tmp_path / "f.onnx"
    assert tool("fuse_onnx", model, out / "plan.json", "-o", fused).returncode == 0
    run = tool("evaluate", model, fused, "--max-tokens", "96", "--window", "12", "--json", "--quiet")
    assert run.returncode == 0, run.stderr
    pooled = json.loads(run.stdout)["results"][-1]
    assert pooled["kl"] == pytest.approx(entry["kl"], rel=1e-6, abs=1e-9)
    assert pooled["ppl_fused"] == pytest.approx(entry["ppl"], rel=1e-6)
    assert pooled["top1_agreement"] == pytest.approx(entry["top1"])


def test_a_second_run_with_another_budget_measures_nothing(tool, model, frontier):
    out, _ = frontier
    budget = ["--min-speedup", "1.0001"]
    run = tool("analyze", model, "--frontier", "--out", out, *budget, "--target-tp", "2", *FAST)
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("plans to measure:"))
    total, cached = line.split(":")[1].split("(")[0].strip(), line.split("(")[1].split()[0]
    assert total == cached


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target", "ultra-253b"], "ultra-253b: the model has 8 blocks"),
        (["--max-kl", "0"], "no plan stays within --max-kl 0: the smallest KL"),
        (["--min-speedup", "9"], "no plan reaches --min-speedup 9: the fastest measured plan predicts"),
        (["--target-tp", "3"], "--tp 3: 4 attention heads do not split over it"),
    ],
)
def test_frontier_user_errors(tool, model, frontier, tmp_path, extra, message):
    out, _ = frontier
    run = tool("analyze", model, "--frontier", "--out", out, *FAST, *extra)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_nothing_to_fuse_is_refused(tool, tmp_path):
    full = [BlockSpec(True, 48)] * 3
    spec = ModelSpec(hidden=32, heads=4, kv_heads=2, vocab=96, tie_embeddings=False, blocks=full)
    path = tmp_path / "m.onnx"
    spec_export(spec, path, seed=1)
    out = tmp_path / "o"
    run = tool("analyze", path, "--frontier", "--out", out, *FAST[:-3], "--block-group", "4", "--quiet")
    assert run.returncode == 2 and "nothing to fuse" in run.stderr, run.stderr
    assert not out.exists()


def test_heal_and_cpu_decode_beside_the_frontier(tool, model, frontier):
    """--heal with a budget heals the chosen plan and measures it on the same text; --bench-tp decodes the
    frontier's plans over gloo ranks. Both from the cached measurements of the first run."""
    out, _ = frontier
    run = tool("analyze", model, "--frontier", "--out", out, "--max-kl", "0.05", "--target-tp", "2", "--heal",
               "--bench-tp", "2", *FAST)
    assert run.returncode == 0, run.stderr
    entries = json.loads((out / "frontier.json").read_text())
    chosen = json.loads((out / "plan.json").read_text())
    healed = [e for e in entries if "healed" in e]
    assert [e["plan"] for e in healed] == [chosen]
    assert healed[0]["healed"]["kl"] < healed[0]["kl"]  # healing brings the chosen plan closer
    assert (out / "healed" / f"{healed[0]['label']}.onnx").is_file()
    front = [e for e in entries if e["on_frontier"] and e["label"] != "original"]
    ratios = {e["label"]: e.get("cpu_tp_decode_ratio") for e in front}
    assert ratios and all(r is not None and r > 0 for r in ratios.values()), ratios
    assert "healed KL" in (out / "frontier.md").read_text() and "CPU TP2 decode" in run.stdout


@pytest.mark.slow
def test_lm_eval_scores_the_frontier_through_the_server(tool, tmp_path):
    """--lm-eval: the original and each fusing frontier plan served (with the tokenizer beside the model) and
    scored by the real lm_eval on license_mc; the accuracy lands in frontier.json and the table."""
    model = sf.tiny_folder(tmp_path) / "model.onnx"
    out = tmp_path / "fr"
    run = tool("analyze", model, "--frontier", "--out", out, "--lm-eval", "--lm-eval-items", "20",
               "--block-group", "0", "--max-steps", "1", "--target-tp", "2", *FAST[:6], "--quiet")
    assert run.returncode == 0, run.stderr
    entries = json.loads((out / "frontier.json").read_text())
    scored = {e["label"]: e["lm_eval_acc"] for e in entries if "lm_eval_acc" in e}
    front = {e["label"] for e in entries if e["on_frontier"]}
    assert set(scored) == front and "original" in scored
    assert all(0 <= acc <= 1 for acc in scored.values())
    assert "lm-eval acc" in (out / "frontier.md").read_text()


def assert_frontier(entries: list[dict]) -> list[dict]:
    """The entries on the frontier: none dominated by any measured plan (as fast or faster and as close or
    closer, strictly better in one), and every entry off it beaten on both by one on it."""
    front = [e for e in entries if e["on_frontier"]]
    for e in front:
        assert not any(
            o["predicted_speedup"] >= e["predicted_speedup"] and o["kl"] <= e["kl"]
            and (o["predicted_speedup"] > e["predicted_speedup"] or o["kl"] < e["kl"])
            for o in entries
        ), e
    for e in entries:
        if not e["on_frontier"]:
            assert any(o["predicted_speedup"] >= e["predicted_speedup"] and o["kl"] <= e["kl"] for o in front)
    return front
