"""The original-vs-fused generation benchmark (tools/bench.py decode): models alternate within every
repetition.

`run_benchmark(settings, original, fused, out, parallel=None)` shards the graphs when TP > 1, times greedy
generation of each on every (batch, prompt length) case (ABBA order, so machine noise hits all alike), and
returns a JSON-ready report: time to first token, decode tokens/s, per-token p50/p90, all-reduces per token
(from the block table) and each model's ratios to the original. The optional third model ("parallel") is
the FFN-fused graph with parallel groups of blocks too (paper section 6: two all-reduces per group instead
of two per block). runtime.bench.report renders it as Markdown and PNG.
With TP > 1 the ranks run as threads in one process, or (`tp_mode="gloo"`) each in its own process with
gloo all-reduces (torch.multiprocessing).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime
from tqdm import tqdm

from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.shard import count_allreduces, rank_onnx_files, read_manifest, shard_file
from runtime.backends import TpRankBackend
from runtime.generate import DecodeModel, GenerationStats, greedy_generate
from runtime.ports import free_port
from runtime.tp.gloo import die_with_parent, init_gloo

FORMAT = "ffn-fusion-bench/1"


@dataclass(frozen=True)
class BenchCase:
    batch: int
    prompt_len: int
    gen_len: int


@dataclass
class DecodeTiming:
    """One model on one case, over all timed repetitions."""

    model: str
    batch: int
    prompt_len: int
    gen_len: int
    reps: int
    ttft_ms: float  # median over repetitions
    decode_tokens_per_s: float  # median over repetitions of (batch x decode steps) / decode seconds
    token_latency_ms_p50: float  # over every decode step of every repetition
    token_latency_ms_p90: float
    ttft_ms_all: list[float] = field(default_factory=list)
    token_agreement: float | None = None  # share of generated tokens equal to the first model's


def time_runs(name: str, case: BenchCase, runs: list[GenerationStats]) -> DecodeTiming:
    steps = np.array([s for r in runs for s in r.step_s], dtype=np.float64)
    ttft = [r.ttft_s * 1e3 for r in runs]
    throughput = [r.decode_tokens_per_s for r in runs]
    return DecodeTiming(
        model=name,
        batch=case.batch,
        prompt_len=case.prompt_len,
        gen_len=case.gen_len,
        reps=len(runs),
        ttft_ms=float(np.median(ttft)),
        decode_tokens_per_s=float(np.median(throughput)),
        token_latency_ms_p50=float(np.percentile(steps, 50) * 1e3) if steps.size else 0.0,
        token_latency_ms_p90=float(np.percentile(steps, 90) * 1e3) if steps.size else 0.0,
        ttft_ms_all=ttft,
    )


def bench_models(
    models: dict[str, DecodeModel],
    cases: Sequence[BenchCase],
    vocab: int,
    reps: int = 5,
    warmup: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> list[DecodeTiming]:
    """Time every model on every case, the models ALTERNATING within each repetition (ABBA order), so that
    machine noise hits all of them alike. Prompts are seeded random tokens; no eos, so every run
    generates exactly gen_len tokens."""

    names = list(models)
    total = len(cases) * (reps + warmup) * len(names)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr)
    results: list[DecodeTiming] = []
    rng = np.random.default_rng(seed)
    for case in cases:
        prompts = rng.integers(0, vocab, (case.batch, case.prompt_len))
        runs: dict[str, list[GenerationStats]] = {n: [] for n in names}
        tokens: dict[str, list[list[int]]] = {}
        for rep in range(warmup + reps):
            bar.set_postfix_str(f"batch {case.batch} prompt {case.prompt_len}")
            for name in names if rep % 2 == 0 else names[::-1]:
                generation = greedy_generate(models[name], prompts, case.gen_len)
                tokens.setdefault(name, generation.tokens)
                if rep >= warmup:
                    runs[name].append(generation.stats)
                bar.update()
        first = np.array(tokens[names[0]])
        for name in names:
            result = time_runs(name, case, runs[name])
            result.token_agreement = float((np.array(tokens[name]) == first).mean())
            results.append(result)
    bar.close()
    return results


def model_info(target: str | Path) -> dict:
    """Block table facts of a decode graph (or of rank 0's graph of a TP folder) for the benchmark.

    allreduces_per_token: passes.shard.count_allreduces, the all-reduces a tensor-parallel forward needs
    (one per attention and per FFN sub-block; a fused group of k FFNs leaves 1 instead of k, a parallel
    group of k blocks 2 instead of 2k).
    """

    path = Path(target)
    info: dict = {"path": str(path)}
    if path.is_dir():
        manifest = read_manifest(path)
        files = rank_onnx_files(path)
        info.update(tp=manifest["tp"], collectives_per_forward=count_allreduces(files[0]))
        source = Path(manifest.get("source", ""))
        path = source if source.is_file() else files[0]
    model = load_model(path)
    blocks = find_blocks(model)
    parallel = sorted({b.parallel for b in blocks if b.parallel is not None})
    logits = next(v for v in model.graph.outputs if v.name == "logits") if model.graph.outputs else None
    vocab = logits.shape[-1] if logits is not None and logits.shape is not None else None
    # KV heads and head dim from passes/graph_inputs.py (GenAI declares the head dim symbolic)
    cache = Signature.of(path).cache_inputs
    kv_bytes = sum((c.static(1) or 0) * (c.static(3) or 0) * 4 for c in cache)
    info.update(
        blocks=len(blocks),
        attention_blocks=sum(b.attention for b in blocks),
        ffn_blocks=len(blocks),
        allreduces_per_token=count_allreduces(model),
        parallel_groups=[list(g) for g in parallel],
        cache_layers=len(cache) // 2,
        kv_cache_bytes_per_token=kv_bytes,
        vocab=int(vocab) if isinstance(vocab, int) else None,
    )
    return info


def _gloo_bench_worker(
    rank: int,
    world: int,
    port: int,
    dirs: dict[str, str],
    cases: list[BenchCase],
    vocab: int,
    reps: int,
    warmup: int,
    threads: int,
    out: str,
) -> None:
    import torch.distributed as dist  # noqa: PLC0415 (torch only in the rank processes of the TP benchmark)

    die_with_parent()
    init_gloo(rank, world, port)
    try:
        models = {name: DecodeModel(TpRankBackend(d, rank, world, threads)) for name, d in dirs.items()}
        results = bench_models(models, cases, vocab, reps, warmup, progress=rank == 0)
        if rank == 0:
            Path(out).write_text(json.dumps([asdict(r) for r in results]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def bench_tp_gloo(
    dirs: dict[str, str | Path],
    world: int,
    cases: Sequence[BenchCase],
    vocab: int,
    reps: int = 5,
    warmup: int = 1,
    threads: int = 1,
) -> list[DecodeTiming]:
    """`bench_models` with every rank in its own process (torch.multiprocessing, gloo all-reduces);
    rank 0's timings are returned. The models still alternate: each rank holds all of them."""
    import torch.multiprocessing as mp  # noqa: PLC0415 (torch only in the rank processes of the TP benchmark)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        args = (
            world,
            free_port(),
            {k: str(v) for k, v in dirs.items()},
            list(cases),
            vocab,
            reps,
            warmup,
            threads,
            str(out),
        )
        mp.spawn(_gloo_bench_worker, args=args, nprocs=world, join=True)
        return [DecodeTiming(**r) for r in json.loads(out.read_text())]


def prepare(settings: BenchSettings, targets: dict[str, Path], out: Path) -> dict[str, Path]:
    """The targets; with TP > 1, .onnx files are sharded into out/shards/<name>_tp<N>."""
    for name, path in targets.items():
        if not path.exists():
            raise UserError(f"--{name} {path} does not exist")
        if settings.tp > 1 and not path.is_dir():
            sharded = out / "shards" / f"{name}_tp{settings.tp}"
            shard_file(path, settings.tp, sharded, progress=settings.progress)
            targets[name] = sharded
        elif settings.tp == 1 and path.is_dir():
            raise UserError(f"--{name} {path} is a sharded folder; pass --tp with its rank count")
    return targets


def measure(settings: BenchSettings, targets: dict[str, Path], vocab: int) -> list[DecodeTiming]:
    s, cases = settings, settings.cases
    if s.tp > 1 and s.tp_mode == "gloo":
        return bench_tp_gloo(targets, s.tp, cases, vocab, s.reps, s.warmup, s.threads or 1)
    models = {
        name: DecodeModel.open(path, device=s.device, threads=s.threads, tp_mode="threads")
        for name, path in targets.items()
    }
    return bench_models(models, cases, vocab, s.reps, s.warmup, s.seed, progress=s.progress)


def machine() -> dict:

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
    }


def speedups(results: list[DecodeTiming]) -> list[dict]:
    """Each model's ratios to the original on every case (> 1: faster), one row per model and case."""
    by_case: dict[tuple[int, int], dict[str, DecodeTiming]] = {}
    for r in results:
        by_case.setdefault((r.batch, r.prompt_len), {})[r.model] = r
    rows = []
    for (batch, prompt), models in by_case.items():
        a = models["original"]
        for name, b in models.items():
            if name == "original":
                continue
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "prompt_len": prompt,
                    "decode_tokens_per_s": b.decode_tokens_per_s / a.decode_tokens_per_s,
                    "ttft": a.ttft_ms / b.ttft_ms,
                    "token_latency_p50": a.token_latency_ms_p50 / b.token_latency_ms_p50,
                    "greedy_token_agreement": b.token_agreement,
                }
            )
    return rows


def report(settings: BenchSettings, infos: dict[str, dict], results: list[DecodeTiming]) -> dict:
    return {
        "format": FORMAT,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "tp": settings.tp,
        "tp_mode": settings.tp_mode if settings.tp > 1 else None,
        "device": settings.device,
        "threads": settings.threads,
        "reps": settings.reps,
        "warmup": settings.warmup,
        "gen_len": settings.gen_len,
        "order": "alternating (ABBA) within every repetition",
        "models": infos,
        "results": [asdict(r) for r in results],
        "speedup": speedups(results),
    }


@dataclass(frozen=True)
class BenchSettings:
    tp: int = 1
    tp_mode: str = "gloo"  # or "threads"
    batch: tuple[int, ...] = (1, 4)
    prompt_len: tuple[int, ...] = (32, 128)
    gen_len: int = 32
    reps: int = 5
    warmup: int = 1
    threads: int | None = None
    device: str = "cpu"
    seed: int = 0
    progress: bool = True

    def check(self) -> None:
        if self.gen_len < 2:
            raise UserError("--gen-len must be at least 2 (one prefill token and at least one decode step)")
        if min(self.batch) < 1 or min(self.prompt_len) < 1 or self.reps < 1 or self.warmup < 0:
            raise UserError("--batch, --prompt-len and --reps must be positive, --warmup not negative")

    @property
    def cases(self) -> list[BenchCase]:
        return [BenchCase(b, p, self.gen_len) for b in self.batch for p in self.prompt_len]


def run_benchmark(
    settings: BenchSettings, original: Path, fused: Path, out: Path, parallel: Path | None = None
) -> dict:
    """Benchmark the graphs (sharded into `out`/shards when TP > 1) and return the report; `parallel`, when
    given, is a third model: the fused graph with parallel groups of blocks too."""
    settings.check()
    targets = {"original": Path(original), "fused": Path(fused)}
    if parallel is not None:
        targets["parallel"] = Path(parallel)
    targets = prepare(settings, targets, out)
    infos = {name: model_info(path) for name, path in targets.items()}
    vocab = infos["original"]["vocab"]
    if not vocab:
        raise UserError(f"cannot tell the vocabulary size of {original} (no static logits dim)")
    return report(settings, infos, measure(settings, targets, vocab))
