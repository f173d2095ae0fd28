"""Greedy generation with a KV cache over any runtime.backends backend.

The graph conventions are those of exporters/decode.py: inputs input_ids, attention_mask and
past_key_<L>/past_value_<L>; outputs logits and present_key_<L>/present_value_<L>. What each input means
comes from passes.graph_inputs, so Optimum / ONNX Runtime GenAI graphs (past_key_values.N.key|value ->
present.N.key|value, position_ids) run too; position_ids are fed as cumsum(attention_mask) - 1. Each
cache's shape comes from its own input, so layers may differ in KV heads (Puzzle checkpoints' variable
GQA) and attention-free or Linear-attention layers simply have no cache. A graph
without cache inputs (a prefill-only export) also works: every step then re-runs the whole sequence (no
cache, equal-length prompts only unless it takes an attention_mask).

Batches: prompts of different lengths are LEFT-padded (pad id, attention_mask 0); the decode graph
computes each row's positions from its mask, so a padded row generates what it would alone.

    text, stats = generate_text("model_decode.onnx", "What is FFN Fusion?", max_new_tokens=32)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from exporters.smollm2_tokenizer import load_tokenizer
from passes.errors import UserError
from passes.graph_inputs import Role, Signature
from runtime.backends import Backend, TensorInfo, open_backend

MASK_INPUT = "attention_mask"
IDS_INPUT = "input_ids"


class DecodeModel:
    """One decode graph behind a backend: builds feeds, keeps the cache, returns logits."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        names = [i.name for i in backend.inputs]
        self.signature = Signature.build(
            [(i.name, np.dtype(i.dtype), i.shape) for i in backend.inputs],
            [(name, np.dtype(np.float32), ()) for name in backend.outputs],
        )
        symbolic = [c for c in self.signature.cache_inputs if c.static(1) is None or c.static(3) is None]
        if symbolic and isinstance(getattr(backend, "path", None), Path):
            self.signature = Signature.of(backend.path)  # GenAI's symbolic head dim, read from the graph
        roles = {i.name: i for i in self.signature.inputs}
        if self.signature.ids is None:
            raise UserError(f"{backend.name}: the graph has no input_ids input (inputs: {names})")
        unknown = [n for n in names if roles[n].role not in (Role.IDS, Role.MASK, Role.POSITIONS, Role.PAST)]
        if unknown:
            raise UserError(f"{backend.name}: cannot feed graph inputs {unknown} (not token ids, "
                            "attention_mask, position_ids or a KV cache)")
        self.past: list[TensorInfo] = [i for i in backend.inputs if roles[i.name].role is Role.PAST]
        self.present = {p.name: self.signature.present_for(p.name) for p in self.past}
        missing = [name for name, present in self.present.items() if present is None]
        if missing:
            raise UserError(f"{backend.name}: no cache outputs for {missing}")
        self.roles = {i.role: i for i in self.signature.inputs}
        self.has_mask = Role.MASK in self.roles
        self.cached = bool(self.past)
        if self.past and not self.has_mask:
            raise UserError(f"{backend.name}: a graph with past inputs needs an attention_mask input")
        self.logits_name = self.signature.logits.name

    @classmethod
    def open(cls, target: str | Path, **kwargs) -> DecodeModel:
        return cls(open_backend(target, **kwargs))

    @property
    def cache_layers(self) -> list[int]:
        return [i.layer for i in self.signature.cache_inputs if i.kind == "key" and i.layer is not None]

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        cache = {}
        for info in self.signature.cache_inputs:
            kv, head_dim = info.static(1), info.static(3)
            if kv is None or head_dim is None:
                raise UserError(f"{info.name} has shape {info.dims}: KV heads and head_dim must be static")
            cache[info.name] = np.zeros((batch, kv, 0, head_dim), dtype=info.dtype)
        return cache

    def cache_bytes(self, cache: dict[str, np.ndarray]) -> int:
        return sum(a.nbytes for a in cache.values())

    def forward(
        self, ids: np.ndarray, mask: np.ndarray | None, cache: dict[str, np.ndarray] | None
    ) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        """Logits [batch, seq, vocab] for `ids` after `cache`; the cache grown by `ids` (None uncached)."""
        values = {Role.IDS: ids, Role.MASK: mask}
        if Role.POSITIONS in self.roles:  # as Hugging Face generation: each row counts its own tokens
            full = np.ones_like(ids) if mask is None else np.asarray(mask)
            values[Role.POSITIONS] = np.maximum(np.cumsum(full, axis=1) - 1, 0)[:, -np.shape(ids)[1] :]
        feeds = {
            self.roles[role].name: np.ascontiguousarray(value, dtype=self.roles[role].dtype)
            for role, value in values.items()
            if role in self.roles
        }
        if cache is not None:
            feeds.update(cache)
        out = self.backend.run(feeds)
        new_cache = {p.name: out[self.present[p.name]] for p in self.past} if self.cached else None
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
