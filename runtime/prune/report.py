"""The pruning report: for the unpruned model and each variant (surgery, distilled, ...), held-out perplexity,
mean KL(unpruned || variant) per position, top-1 agreement, and where the model's tokenizer is known the
accuracy of the offline lm-eval task license_mc (runtime.lm_tasks), scored in torch the way lm-eval's
loglikelihood multiple choice scores it (the choice with the largest summed log-probability after the
context and a space). The held-out text is runtime.text_sets.held_out_sets, never calibrated on."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.lm_tasks import license_task
from runtime.prune.model import PruneModel
from runtime.text_sets import TextSet, model_tokenizer

TASK_ITEMS = 100


@dataclass(frozen=True)
class QualityRow:
    name: str
    tokens: int
    perplexity: float
    kl: float
    top1: float
    acc: float | None  # license_mc accuracy (None: no tokenizer known for the vocabulary)
    items: int = 0  # license_mc items scored

    def cells(self, base: float) -> list[str]:
        acc = "-" if self.acc is None else f"{self.acc:.2f}"
        change = f"{100 * (self.perplexity / base - 1):+.1f}%"
        return [self.name, f"{self.perplexity:.2f}", change, f"{self.kl:.4f}", f"{self.top1:.3f}", acc]


@torch.no_grad()
def score(original: PruneModel, variants: dict[str, PruneModel], sets: Sequence[TextSet], batch: int = 2,
          task_items: int = TASK_ITEMS) -> list[QualityRow]:
    """One row for the original (KL 0, top-1 1) and one per variant, pooled over all held-out sets."""
    models = {"unpruned": original, **variants}
    nll = dict.fromkeys(models, 0.0)
    kl = dict.fromkeys(models, 0.0)
    agree = dict.fromkeys(models, 0)
    predicted = positions = 0
    for text in sets:
        for start in range(0, len(text.windows), batch):
            ids = torch.from_numpy(np.ascontiguousarray(text.windows[start : start + batch]))
            reference = torch.log_softmax(original.forward(ids), -1)
            top = reference.argmax(-1)
            for name, model in models.items():
                logp = reference if model is original else torch.log_softmax(model.forward(ids), -1)
                nll[name] -= float(logp[:, :-1].gather(-1, ids[:, 1:, None]).double().sum())
                kl[name] += float((reference.exp() * (reference - logp)).double().sum())
                agree[name] += int((logp.argmax(-1) == top).sum())
            predicted += ids[:, 1:].numel()
            positions += ids.numel()
    accuracy = task_accuracy(models, original.config.vocab, task_items)
    return [
        QualityRow(name, positions, float(np.exp(nll[name] / max(predicted, 1))), kl[name] / positions,
                   agree[name] / positions, accuracy.get(name), task_items if accuracy else 0)
        for name in models
    ]


@torch.no_grad()
def task_accuracy(models: dict[str, PruneModel], vocab: int, items: int) -> dict[str, float]:
    """license_mc accuracy of each model ({} when the vocabulary's tokenizer is unknown)."""
    tokenizer = model_tokenizer(None, vocab)
    if tokenizer is None or items <= 0:
        return {}
    with tempfile.TemporaryDirectory() as folder:
        task = license_task(Path(folder), items)
        rows = [json.loads(line) for line in (task / "items.jsonl").read_text().splitlines()]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prepared = []
    for row in rows:
        context = encode(row["context"])
        choices = [encode(row["context"] + " " + c)[len(context):] for c in row["choices"]]
        prepared.append((context, choices, row["label"]))
    # One torch thread: the items are tiny tensors, where a second thread only adds synchronization, and on a
    # loaded machine its spin-waits cost 8-10x the CPU (measured, 20 items: 60-78 s CPU with 2 threads, 7.5
    # s with 1; journal/2026-12-06-demo-times.md).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _score_items(models, prepared)
    finally:
        torch.set_num_threads(threads)


def _score_items(models: dict[str, PruneModel], prepared: list) -> dict[str, float]:
    scores = {}
    for name, model in models.items():
        correct = 0
        for context, choices, label in prepared:
            length = len(context) + max(map(len, choices))
            ids = torch.zeros(len(choices), length, dtype=torch.int64)
            for k, choice in enumerate(choices):
                ids[k, : len(context) + len(choice)] = torch.tensor(context + choice)
            # the lm_head (a fifth of the model) only where a choice token is predicted
            start = len(context) - 1
            logp = torch.log_softmax(model.logits(model.stream(ids)[:, start:]), -1)
            totals = [
                float(sum(logp[k, t, token] for t, token in enumerate(choice)))
                for k, choice in enumerate(choices)
            ]
            correct += int(np.argmax(totals) == label)
        scores[name] = correct / len(prepared)
    return scores


def format_report(rows: Sequence[QualityRow]) -> str:
    """A Markdown table; perplexity change against the first (unpruned) row."""
    base = rows[0].perplexity
    header = ["model", "perplexity", "vs unpruned", "KL", "top-1", f"license_mc acc ({rows[0].items} items)"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r.cells(base)) + " |" for r in rows]
    return "\n".join(lines)


def rows_record(rows: Sequence[QualityRow]) -> list[dict]:
    return [asdict(r) for r in rows]
