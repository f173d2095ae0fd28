"""Greedy generation with a KV cache over any runtime.backends backend.

The graph conventions are those of exporters/decode.py: inputs input_ids, attention_mask and
past_key_<L>/past_value_<L>; outputs logits and present_key_<L>/present_value_<L>. A graph with only
`input_ids` (a prefill-only export) also works: every step then re-runs the whole sequence (no cache,
equal-length prompts only).

Batches: prompts of different lengths are LEFT-padded (pad id, attention_mask 0); the decode graph
computes each row's positions from its mask, so a padded row generates what it would alone.

    text, stats = generate_text("model_decode.onnx", "What is FFN Fusion?", max_new_tokens=32)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from passes.errors import UserError
from runtime.backends import Backend, TensorInfo, open_backend

MASK_INPUT = "attention_mask"
IDS_INPUT = "input_ids"


def _present_name(past_name: str) -> str:
    return "present_" + past_name.removeprefix("past_")


class DecodeModel:
    """One decode graph behind a backend: builds feeds, keeps the cache, returns logits."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        names = [i.name for i in backend.inputs]
        if IDS_INPUT not in names:
            raise UserError(f"{backend.name}: the graph has no input_ids input (inputs: {names})")
        self.past: list[TensorInfo] = [i for i in backend.inputs if i.name.startswith("past_")]
        missing = [_present_name(p.name) for p in self.past if _present_name(p.name) not in backend.outputs]
        if missing:
            raise UserError(f"{backend.name}: cache outputs missing: {missing}")
        self.has_mask = MASK_INPUT in names
        self.cached = self.has_mask
        if self.past and not self.has_mask:
            raise UserError(f"{backend.name}: a graph with past inputs needs an attention_mask input")
        self.logits_name = "logits" if "logits" in backend.outputs else backend.outputs[0]

    @classmethod
    def open(cls, target: str | Path, **kwargs) -> DecodeModel:
        return cls(open_backend(target, **kwargs))

    @property
    def cache_layers(self) -> list[int]:
        return [int(p.name.rsplit("_", 1)[1]) for p in self.past if p.name.startswith("past_key_")]

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        cache = {}
        for info in self.past:
            _, kv, _, head_dim = info.shape
            if not isinstance(kv, int) or not isinstance(head_dim, int):
                raise UserError(f"{info.name} has shape {info.shape}: KV heads and head_dim must be static")
            cache[info.name] = np.zeros((batch, kv, 0, head_dim), dtype=info.dtype)
        return cache

    def cache_bytes(self, cache: dict[str, np.ndarray]) -> int:
        return sum(a.nbytes for a in cache.values())

    def forward(
        self, ids: np.ndarray, mask: np.ndarray | None, cache: dict[str, np.ndarray] | None
    ) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        """Logits [batch, seq, vocab] for `ids` after `cache`; the cache grown by `ids` (None uncached)."""
        feeds = {IDS_INPUT: np.ascontiguousarray(ids, dtype=np.int64)}
        if self.has_mask:
            feeds[MASK_INPUT] = np.ascontiguousarray(mask, dtype=np.int64)
        if cache is not None:
            feeds.update(cache)
        out = self.backend.run(feeds)
        new_cache = {p.name: out[_present_name(p.name)] for p in self.past} if self.cached else None
        return out[self.logits_name], new_cache


@dataclass
class GenerationStats:
    batch: int
    prompt_len: int  # after left padding
    new_tokens: int
    ttft_s: float  # prefill to the first generated token
    step_s: list[float] = field(default_factory=list)  # each decode step after the first token
    cache_bytes: int = 0
    backend: str = ""

    @property
    def decode_s(self) -> float:
        return float(sum(self.step_s))

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over the decode steps, all rows of the batch counted."""
        return self.batch * len(self.step_s) / self.decode_s if self.step_s else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["decode_s"] = self.decode_s
        data["decode_tokens_per_s"] = self.decode_tokens_per_s
        return data


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row (up to and including eos)
    stats: GenerationStats


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) [batch, longest]: each prompt right-aligned, pad_token_id / 0 on its left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def greedy_generate(
    model: DecodeModel,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> Generation:
    """Greedy decoding: prefill the prompts, then one token per step from the KV cache.

    Stops after `max_new_tokens`, or when every row has produced `eos_token_id`. Finished rows keep
    running (their tokens are dropped) so that the batch keeps its shape.
    """
    if max_new_tokens < 1:
        raise UserError("max_new_tokens must be at least 1")
    ids, mask = left_pad([list(map(int, p)) for p in prompts], pad_token_id)
    if not model.cached and not mask.all():
        raise UserError("a graph without a KV cache (input_ids only) needs prompts of equal length")
    vocab = getattr(model.backend, "vocab", None)
    if vocab is not None and int(ids.max()) >= vocab:
        raise UserError(
            f"prompt token id {int(ids.max())} is outside the model's vocabulary of {vocab} "
            "(a tokenizer for another model?)"
        )
    batch = ids.shape[0]
    cache = model.empty_cache(batch) if model.cached else None
    start = time.perf_counter()
    logits, cache = model.forward(ids, mask, cache)
    token = logits[:, -1].argmax(-1)
    stats = GenerationStats(batch, ids.shape[1], 1, time.perf_counter() - start, backend=model.backend.name)
    generated = [token]
    done = token == eos_token_id if eos_token_id is not None else np.zeros(batch, dtype=bool)
    sequence = ids
    for _ in range(max_new_tokens - 1):
        if done.all():
            break
        if on_step is not None:
            on_step(len(generated))
        step_ids = token[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        t0 = time.perf_counter()
        if model.cached:
            logits, cache = model.forward(step_ids, mask, cache)
        else:
            sequence = np.concatenate([sequence, step_ids], axis=1)
            logits, _ = model.forward(sequence, mask, None)
        token = logits[:, -1].argmax(-1)
        stats.step_s.append(time.perf_counter() - t0)
        generated.append(token)
        if eos_token_id is not None:
            done |= token == eos_token_id
    stats.new_tokens = len(generated)
    stats.cache_bytes = model.cache_bytes(cache) if cache else 0
    return Generation(_rows(np.stack(generated, axis=1), eos_token_id), stats)


def _rows(tokens: np.ndarray, eos_token_id: int | None) -> list[list[int]]:
    rows = []
    for row in tokens.tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- text


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt`; with `chat`, wrapped in the tokenizer's chat template (SmolLM2-Instruct)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt)["input_ids"])


def generate_text(
    decode_onnx_path: str | Path,
    prompt: str | Sequence[str],
    max_new_tokens: int = 32,
    *,
    chat: bool = True,
    device: str = "cpu",
    threads: int | None = None,
    tokenizer=None,
    model: DecodeModel | None = None,
) -> tuple[str | list[str], GenerationStats]:
    """Generate greedily from a decode graph (or a TP folder) with the SmolLM2 tokenizer.

    Returns (text, stats): one string for one prompt, a list for a list of prompts (left-padded batch).
    Generation stops at the tokenizer's eos token (<|im_end|> for SmolLM2-Instruct).
    """
    if tokenizer is None:
        from exporters.smollm2 import load_tokenizer

        tokenizer = load_tokenizer()
    if model is None:
        model = DecodeModel.open(decode_onnx_path, device=device, threads=threads)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    encoded = [encode_prompt(tokenizer, p, chat) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = greedy_generate(
        model, encoded, max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad
    )
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in result.tokens]
    return (texts[0] if isinstance(prompt, str) else texts), result.stats


# -------------------------------------------------------------------------------------- benchmark


@dataclass(frozen=True)
class BenchCase:
    batch: int
    prompt_len: int
    gen_len: int


@dataclass
class BenchResult:
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


def summarize(name: str, case: BenchCase, runs: list[GenerationStats]) -> BenchResult:
    steps = np.array([s for r in runs for s in r.step_s], dtype=np.float64)
    ttft = [r.ttft_s * 1e3 for r in runs]
    throughput = [r.decode_tokens_per_s for r in runs]
    return BenchResult(
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
) -> list[BenchResult]:
    """Time every model on every case, the models ALTERNATING within each repetition (ABBA order), so that
    machine noise hits all of them alike. Prompts are seeded random tokens; no eos, so every run
    generates exactly gen_len tokens."""
    from tqdm import tqdm

    names = list(models)
    total = len(cases) * (reps + warmup) * len(names)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr)
    results: list[BenchResult] = []
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
            result = summarize(name, case, runs[name])
            result.token_agreement = float((np.array(tokens[name]) == first).mean())
            results.append(result)
    bar.close()
    return results


def model_info(target: str | Path) -> dict:
    """Block table facts of a decode graph (or of rank 0's graph of a TP folder) for the benchmark.

    allreduces_per_token: one per attention sub-block (o_proj) and one per FFN sub-block (down_proj), the
    all-reduces a tensor-parallel forward needs; fusing a group of k FFNs leaves 1 instead of k.
    """
    from passes.blocks import find_blocks
    from passes.model_io import load_model

    path = Path(target)
    info: dict = {"path": str(path)}
    if path.is_dir():
        from passes.shard import count_allreduces, rank_onnx_files, read_manifest

        manifest = read_manifest(path)
        files = rank_onnx_files(path)
        info.update(tp=manifest["tp"], collectives_per_forward=count_allreduces(files[0]))
        source = Path(manifest.get("source", ""))
        path = source if source.is_file() else files[0]
    model = load_model(path)
    blocks = find_blocks(model)
    logits = next(v for v in model.graph.outputs if v.name == "logits") if model.graph.outputs else None
    vocab = logits.shape[-1] if logits is not None and logits.shape is not None else None
    cache = [v for v in model.graph.inputs if v.name.startswith("past_")]
    kv_bytes = sum(int(v.shape[1]) * int(v.shape[3]) * 4 for v in cache if v.shape is not None)
    info.update(
        blocks=len(blocks),
        attention_blocks=sum(b.attention for b in blocks),
        ffn_blocks=len(blocks),
        allreduces_per_token=sum(1 + b.attention for b in blocks),
        cache_layers=len(cache) // 2,
        kv_cache_bytes_per_token=kv_bytes,
        vocab=int(vocab) if isinstance(vocab, int) else None,
    )
    return info


# ------------------------------------------------------------------------------ TP over gloo (CPU)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


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
    import torch.distributed as dist

    from runtime.backends import TpRankBackend

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
) -> list[BenchResult]:
    """`bench_models` with every rank in its own process (torch.multiprocessing, gloo all-reduces);
    rank 0's timings are returned. The models still alternate: each rank holds all of them."""
    import torch.multiprocessing as mp

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
        return [BenchResult(**r) for r in json.loads(out.read_text())]
