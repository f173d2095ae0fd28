"""What `tools/serve.py MODEL` serves: the graph (or engine, or TP folder), its tokenizer and its limits.

MODEL may be
- an ONNX file (ONNX Runtime), a TensorRT engine file (*.engine / *.plan), or
- a folder: a sharded TP folder (passes.shard's tp.json; one process per rank, runtime.serve.tp_ranks),
  an engines folder from tools/build_engines.py (one *.engine), or an export folder holding model.onnx
  (Optimum: model.onnx or decoder_model_merged.onnx; ONNX Runtime GenAI: model.onnx + genai_config.json;
  or the folder's only .onnx file).

The tokenizer is the folder's (tokenizer.json / tokenizer_config.json, through transformers), else
SmolLM2's when the vocabulary is SmolLM2's (runtime.text_sets.model_tokenizer). End-of-sequence ids come from
generation_config.json, genai_config.json and the tokenizer; the context length from config.json
(max_position_embeddings) or genai_config.json (context_length).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from passes.errors import UserError
from runtime.backends import Backend, OrtBackend, TrtBackend
from runtime.generate import DecodeModel
from runtime.serve.batch import Runner, runner_for
from runtime.serve.tp_ranks import TpRanks
from runtime.text_sets import is_tokenizer_folder, json_object, model_tokenizer

BACKENDS = ("auto", "ort", "tensorrt", "tp")
ENGINE_SUFFIXES = (".engine", ".plan")
ONNX_NAMES = ("model.onnx", "decoder_model_merged.onnx", "decoder_model.onnx")
DEFAULT_CONTEXT = 2048
TP_MANIFEST = "tp.json"  # passes.shard.MANIFEST (not imported: passes.shard pulls in the sharding pass)


@dataclass(frozen=True)
class ModelSource:
    backend: str  # ort, tensorrt or tp
    target: Path  # the ONNX file, the engine file, or the TP folder
    folder: Path  # where tokenizer and config files are looked for


@dataclass
class ServedModel:
    id: str
    model: DecodeModel | None  # None for a TP folder: its ranks run in their own processes (`ranks`)
    tokenizer: Any
    eos_ids: frozenset[int]
    max_context: int
    source: ModelSource
    created: int
    max_batch: int | None = None  # a TensorRT engine's profile bounds the batch ...
    max_prompt: int | None = None  # ... and the tokens of one call (the prefill)
    left_padding: bool = True  # False: GenAI's GroupQueryAttention graphs (runtime.serve.batch.GroupedRunner)
    ranks: TpRanks | None = None

    @property
    def vocab(self) -> int | None:
        return self.ranks.vocab if self.ranks is not None else self.model.backend.vocab

    def runner(self) -> Runner:
        """What the scheduler drives: the rank processes of a TP folder, else a runner over the model."""
        return self.ranks if self.ranks is not None else runner_for(self.model, self.left_padding)

    def close(self) -> None:
        """Stop the rank processes (a TP folder); nothing to do for a model in this process."""
        if self.ranks is not None:
            self.ranks.close()


def resolve(target: str | Path, backend: str = "auto") -> ModelSource:
    """Which file or folder to open with which backend (module docstring)."""
    path = Path(target)
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if not path.exists():
        raise UserError(f"model {path} does not exist")
    if path.is_file():
        kind = "tensorrt" if path.suffix in ENGINE_SUFFIXES else "ort" if path.suffix == ".onnx" else None
        if kind is None or backend not in ("auto", kind):
            raise UserError(f"{path}: --backend {backend} needs {_wants(backend)}")
        return ModelSource(kind, path, path.parent)
    if (path / TP_MANIFEST).is_file() and backend in ("auto", "tp"):
        return ModelSource("tp", path, _tp_folder(path))
    if backend == "tp":
        raise UserError(f"{path} has no {TP_MANIFEST}: --backend tp needs a folder from tools/shard_tp.py")
    engines = sorted(p for p in path.iterdir() if p.suffix in ENGINE_SUFFIXES)
    onnx_file = _onnx_in(path)
    if backend == "tensorrt" or (backend == "auto" and engines and onnx_file is None):
        if len(engines) != 1:
            raise UserError(
                f"{path}: --backend tensorrt needs exactly one engine file there, found "
                f"{[e.name for e in engines] or 'none'} (serve rank engines with their TP folder)"
            )
        return ModelSource("tensorrt", engines[0], path)
    if onnx_file is None:
        raise UserError(f"{path} holds no model.onnx (or single .onnx file), engine or {TP_MANIFEST}")
    return ModelSource("ort", onnx_file, path)


def _wants(backend: str) -> str:
    return {
        "ort": "an .onnx file or folder",
        "tensorrt": "an .engine/.plan file or engines folder",
        "tp": "a sharded folder (tp.json)",
    }.get(backend, "an .onnx, .engine or .plan file, or a folder")


def _onnx_in(folder: Path) -> Path | None:
    for name in ONNX_NAMES:
        if (folder / name).is_file():
            return folder / name
    files = sorted(folder.glob("*.onnx"))
    if len(files) > 1:
        raise UserError(
            f"{folder} holds several .onnx files ({', '.join(f.name for f in files)}): name the one to serve"
        )
    return files[0] if files else None


def _tp_folder(folder: Path) -> Path:
    """Tokenizer folder of a TP folder: itself when it has one, else the sharded source model's folder."""
    if is_tokenizer_folder(folder):
        return folder
    source = json.loads((folder / TP_MANIFEST).read_text(encoding="utf-8")).get("source", "")
    return Path(source).parent if source else folder


def backend_for(source: ModelSource, device: str = "cpu", threads: int | None = None) -> Backend:
    """The in-process backend of a resolved ORT or TensorRT source (a TP folder runs as TpRanks)."""
    if source.backend == "tensorrt":
        return TrtBackend(source.target)
    return OrtBackend(source.target, device, threads)


def load(
    target: str | Path,
    backend: str = "auto",
    *,
    name: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    max_context: int | None = None,
    tp_comm: str = "gloo",
    rank_timeout_s: float = 120.0,
    rank_heartbeat_s: float = 5.0,
) -> ServedModel:
    """MODEL -> ServedModel; a TP folder's rank processes start here (`ServedModel.close` stops them)."""
    source = resolve(target, backend)
    left_padding = not (source.folder / "genai_config.json").is_file()
    if source.backend == "tp":
        ranks = TpRanks(
            source.target,
            left_padding=left_padding,
            threads=threads or 1,
            comm=tp_comm,
            timeout_s=rank_timeout_s,
            heartbeat_timeout_s=rank_heartbeat_s,
        )
        try:
            return _served(target, name, source, None, ranks, max_context, left_padding)
        except BaseException:
            ranks.close()
            raise
    model = DecodeModel(backend_for(source, device, threads))
    model.empty_cache(1)  # a cache that cannot be made (symbolic KV dims) fails now, not at the first request
    return _served(target, name, source, model, None, max_context, left_padding)


def _served(
    target: str | Path,
    name: str | None,
    source: ModelSource,
    model: DecodeModel | None,
    ranks: TpRanks | None,
    max_context: int | None,
    left_padding: bool,
) -> ServedModel:
    tokenizer = load_tokenizer(source.folder, ranks.vocab if ranks is not None else model.backend.vocab)
    config = json_object(source.folder / "config.json")
    genai = json_object(source.folder / "genai_config.json").get("model", {})
    context = int(max_context or config.get("max_position_embeddings") or genai.get("context_length") or 0)
    limits = engine_limits(source.target) if source.backend == "tensorrt" else EngineLimits()
    if limits.total:
        context = min(context, limits.total) if context else limits.total
    return ServedModel(
        id=name or (Path(target).stem if Path(target).is_file() else Path(target).resolve().name),
        model=model,
        tokenizer=tokenizer,
        eos_ids=eos_ids(source.folder, tokenizer, genai),
        max_context=context or DEFAULT_CONTEXT,
        source=source,
        created=int(time.time()),
        max_batch=limits.batch,
        max_prompt=limits.seq,
        left_padding=left_padding,
        ranks=ranks,
    )


@dataclass(frozen=True)
class EngineLimits:
    batch: int | None = None
    seq: int | None = None  # input_ids tokens per call
    total: int | None = None  # past + new tokens (attention_mask length)


def engine_limits(engine: Path) -> EngineLimits:
    """The bounds of a TensorRT engine's optimization profile, from its sidecar <engine>.json
    (exporters.tensorrt.build): max batch and sequence of input_ids, max length of attention_mask."""
    profile = json_object(engine.with_name(engine.name + ".json")).get("profile") or {}
    ids, mask = profile.get("input_ids", {}).get("max"), profile.get("attention_mask", {}).get("max")
    return EngineLimits(
        batch=int(ids[0]) if ids else None,
        seq=int(ids[1]) if ids and len(ids) > 1 else None,
        total=int(mask[1]) if mask and len(mask) > 1 else None,
    )


def load_tokenizer(folder: Path, vocab: int | None) -> Any:
    tokenizer = model_tokenizer(folder, vocab or None)
    if tokenizer is None:
        raise UserError(
            f"no tokenizer.json in {folder}, and the vocabulary ({vocab}) is not SmolLM2's: "
            "put the model's tokenizer.json (and tokenizer_config.json) beside it"
        )
    return tokenizer


def eos_ids(folder: Path, tokenizer: Any, genai: dict) -> frozenset[int]:
    ids: set[int] = set()
    for value in (
        json_object(folder / "generation_config.json").get("eos_token_id"),
        genai.get("eos_token_id"),
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)

