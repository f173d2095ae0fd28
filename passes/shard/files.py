"""Files of a sharded model: DIR/rank{r}/model.onnx (+ model.onnx.data) per rank and DIR/tp.json."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx_ir as ir
from tqdm import tqdm

from passes.errors import UserError
from passes.io.model_io import (
    EXTERNAL_DATA_THRESHOLD,
    has_external_data,
    load_model,
    save_model,
    weight_bytes,
)
from passes.shard.collectives import COLLECTIVE_DOMAIN, COLLECTIVE_OP, reject_rank_graph
from passes.shard.partition import HeadPlan
from passes.shard.rank_pass import ShardRank
from passes.shard.rewrite import RankInfo
from passes.shard.roles import find_structure

MANIFEST = "tp.json"


MANIFEST_FORMAT = "ffn-fusion-tp/1"


@dataclass
class BranchSummary:
    index: int
    kind: str
    width: int = 0
    padded_width: int = 0
    heads: int = 0
    kv_heads: int = 0
    kv_heads_per_rank: int = 0
    heads_per_rank: int = 0  # padded with zero heads when tp does not divide the heads
    cache_inputs: list[str] = field(default_factory=list)  # decode graphs: past K/V graph inputs
    cache_outputs: list[str] = field(default_factory=list)  # and the present outputs they become
    group: int | None = None  # the parallel group of blocks the branch belongs to (two all-reduces a group)


@dataclass
class ShardReport:
    out_dir: Path
    tp: int
    rank_files: list[Path]
    allreduces_per_forward: int
    allgathers_per_forward: int
    lm_head: str
    branches: list[BranchSummary] = field(default_factory=list)
    seconds: float = 0.0
    external_data: bool = False

    def lines(self) -> list[str]:
        alone = [b for b in self.branches if b.group is None]
        att = sum(b.kind == "attention" for b in alone)
        ffn = len(alone) - att
        padded = [b for b in self.branches if b.padded_width != b.width and b.kind == "ffn"]
        out = [
            f"tp={self.tp}: {len(self.rank_files)} rank graphs in {self.out_dir}",
            f"all-reduces per forward: {self.allreduces_per_forward} ({att} attention + {ffn} FFN"
            + (f" + {parallel_note(self.branches)})" if len(alone) < len(self.branches) else ")")
            + (f", all-gathers: {self.allgathers_per_forward}" if self.allgathers_per_forward else ""),
        ]
        if padded:
            shown = ", ".join(f"{b.width}->{b.padded_width}" for b in padded[:6])
            out.append(
                f"FFN widths padded with zeros to a multiple of {self.tp}: {shown}"
                + (" ..." if len(padded) > 6 else "")
            )
        padded_heads = sorted(
            {
                (b.heads, b.kv_heads, b.heads_per_rank)
                for b in self.branches
                if b.kind == "attention" and b.heads_per_rank * self.tp != b.heads
            }
        )
        for heads, kv, per_rank in padded_heads:
            out.append(
                f"attention heads padded with zero heads: {heads} heads / {kv} KV heads -> "
                f"{per_rank} per rank x {self.tp} = {per_rank * self.tp}"
            )
        cached = [b for b in self.branches if b.cache_inputs]
        if cached:
            per_rank = sorted({b.kv_heads_per_rank for b in cached})
            out.append(
                f"KV cache: {sum(len(b.cache_inputs) for b in cached)} past inputs in {len(cached)} "
                f"attention branches, {'/'.join(map(str, per_rank))} KV head(s) per rank"
            )
        out.append(f"lm_head: {self.lm_head}; {self.seconds:.1f} s")
        return out


def parallel_note(branches: list[BranchSummary]) -> str:
    """'2 x 2 in parallel groups of 3 and 4 blocks, 10 saved': two all-reduces per group instead of two per
    member block."""
    sizes = Counter(b.group for b in branches if b.group is not None and b.kind == "attention")
    shown = " and ".join(str(n) for n in sizes.values())
    saved = sum(2 * n - 2 for n in sizes.values())
    return f"{len(sizes)} x 2 in parallel groups of {shown} blocks, {saved} saved"


def branch_summaries(model: ir.Model, tp: int) -> list[BranchSummary]:
    reject_rank_graph(model)
    structure = find_structure(model)
    out = []
    for b in structure.branches:
        padded = math.ceil(b.width / tp) * tp if b.kind == "ffn" else 0
        summary = BranchSummary(b.index, b.kind, b.width, padded, b.heads, b.kv_heads, group=b.group)
        if b.kind == "attention":
            plan = HeadPlan(b.heads, b.kv_heads, tp)
            summary.kv_heads_per_rank = plan.kv_per_rank
            summary.heads_per_rank = plan.heads_per_rank
            summary.cache_inputs = [c.past.name for c in b.caches]
            summary.cache_outputs = [c.present.name for c in b.caches if c.present is not None]
        out.append(summary)
    return out


def shard_file(
    model_path: str | Path,
    tp: int,
    out_dir: str | Path,
    *,
    lm_head: str = "replicated",
    external_data: bool | None = None,
    max_data_file_bytes: int | None = None,
    progress: bool = True,
) -> ShardReport:
    """Write DIR/rank{r}/model.onnx (+ model.onnx.data, or numbered data files of at most
    `max_data_file_bytes`) for every rank and DIR/tp.json: the source loaded once per rank, rewritten by
    the ShardRank pass and saved before the next rank is loaded."""
    rank_passes = [ShardRank(tp, rank, lm_head) for rank in range(tp)]  # refuses a bad tp or lm_head first
    model_path, out_dir = Path(model_path), Path(out_dir)
    if out_dir.resolve() == model_path.parent.resolve():
        raise UserError(f"--out {out_dir} is the model's own folder; choose a new folder")
    start = time.perf_counter()
    source_external = has_external_data(model_path)
    summary = branch_summaries(load_model(model_path), tp)
    files: list[Path] = []
    infos: list[RankInfo] = []
    external = False
    bar = _progress(tp, progress)
    for rank in range(tp):
        model = load_model(model_path)
        rank_passes[rank](model)
        infos.append(rank_passes[rank].info)
        path = out_dir / f"rank{rank}" / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        big = weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
        external = external_data if external_data is not None else (source_external or big)
        save_model(model, path, external, max_data_file_bytes)  # removes an earlier save's data files
        files.append(path)
        del model
        bar(rank)
    report = ShardReport(
        out_dir,
        tp,
        files,
        infos[0].allreduces,
        infos[0].allgathers,
        lm_head,
        summary,
        time.perf_counter() - start,
        external,
    )
    write_manifest(report, model_path)
    return report


def shard_model(model_path: str | Path, tp: int, out_dir: str | Path, **kwargs) -> list[Path]:
    """The rank ONNX files (rank 0 first) of `model_path` sharded over `tp` ranks into `out_dir`."""
    return shard_file(model_path, tp, out_dir, **kwargs).rank_files


def _progress(total: int, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda rank: None
    bar = tqdm(total=total, desc="sharding", unit="rank", file=sys.stderr, leave=False)

    def step(rank: int) -> None:
        bar.update(1)
        if rank == total - 1:
            bar.close()

    return step


def write_manifest(report: ShardReport, source: Path) -> Path:
    data = {
        "format": MANIFEST_FORMAT,
        "tp": report.tp,
        "ranks": [str(p.relative_to(report.out_dir)) for p in report.rank_files],
        "allreduces_per_forward": report.allreduces_per_forward,
        "allgathers_per_forward": report.allgathers_per_forward,
        "lm_head": report.lm_head,
        "collective": {"op": COLLECTIVE_OP, "domain": COLLECTIVE_DOMAIN},
        "external_data": report.external_data,
        "source": str(source),
        "branches": [asdict(b) for b in report.branches],
    }
    path = report.out_dir / MANIFEST
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(f"{directory} has no {MANIFEST}; write it with tools/shard_tp.py")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    if data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("ranks"), list):
        raise UserError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    return data


def rank_onnx_files(directory: str | Path) -> list[Path]:
    """The rank graphs of a sharded folder, rank 0 first (one TensorRT engine is built per file)."""
    directory = Path(directory)
    data = read_manifest(directory)
    files = [directory / r for r in data["ranks"]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{directory}: rank graph(s) missing: {', '.join(missing)}")
    if len(files) != data["tp"]:
        raise UserError(f"{directory / MANIFEST}: tp={data['tp']} but {len(files)} rank files listed")
    return files
