"""Quality of a fused model against its original on held-out text (ONNX Runtime, CPU).

For each set of fixed-length token windows, both models run on the same batches and we report:
- perplexity of each: exp(mean negative log-likelihood of token t+1 given tokens <= t), within windows;
- top-1 agreement: the fraction of positions where both models' most likely next token is the same;
- KL(original || fused): mean over positions of sum_v p_orig(v) (log p_orig(v) - log p_fused(v)), nats;
- logits cosine: mean over positions of the cosine between the two logit vectors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.io.model_io import load_proto
from passes.run.block_runner import session
from runtime.text_sets import TextSet

METRICS = ("tokens", "ppl_original", "ppl_fused", "top1_agreement", "kl", "logits_cosine")


@dataclass
class QualityResult:
    name: str
    tokens: int  # positions compared (perplexity uses the windows' next-token positions)
    ppl_original: float
    ppl_fused: float
    top1_agreement: float
    kl: float
    logits_cosine: float

    def row(self) -> dict:
        return asdict(self)


# Positions per float64 temporary: 32 x 49152 x 8 B = 12 MB, reused by the allocator (a whole batch's float64
# log-probabilities were hundreds of MB of fresh pages each time: a third of the frontier's CPU).
ROWS = 32


class _Sums:
    """Running sums over positions, so that memory stays at one batch of logits."""

    def __init__(self) -> None:
        self.nll = np.zeros(2)
        self.predicted = 0
        self.positions = 0
        self.agree = 0
        self.kl = 0.0
        self.cos = 0.0

    def add(self, ids: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """One batch: token ids [..., T], both models' logits [..., T, V]; float64, a few rows at a time."""
        vocab = a.shape[-1]
        following = np.full(ids.shape, -1, dtype=np.int64)  # the next token within the window; -1 at its end
        following[..., :-1] = ids[..., 1:]
        following = following.reshape(-1)
        a, b = a.reshape(-1, vocab), b.reshape(-1, vocab)
        for start in range(0, len(a), ROWS):
            rows = slice(start, start + ROWS)
            a64, b64 = a[rows].astype(np.float64), b[rows].astype(np.float64)
            (la, pa), lb = log_softmax_and_probs(a64), log_softmax(b64)
            scored = np.nonzero(following[rows] >= 0)[0]
            targets = following[rows][scored]
            self.nll -= la[scored, targets].sum(), lb[scored, targets].sum()
            self.predicted += len(scored)
            self.agree += int((a64.argmax(-1) == b64.argmax(-1)).sum())
            self.kl += float((pa * (la - lb)).sum())
            dots = np.einsum("pv,pv->p", a64, b64)
            norms = np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1)
            self.cos += float((dots / np.maximum(norms, 1e-300)).sum())
        self.positions += ids.size

    def merge(self, other: _Sums) -> None:
        self.nll += other.nll
        for key in ("predicted", "positions", "agree", "kl", "cos"):
            setattr(self, key, getattr(self, key) + getattr(other, key))

    def result(self, name: str) -> QualityResult:
        ppl = np.exp(self.nll / max(self.predicted, 1)) if self.predicted else np.full(2, np.nan)
        n = max(self.positions, 1)
        return QualityResult(
            name, self.positions, float(ppl[0]), float(ppl[1]), self.agree / n, self.kl / n, self.cos / n
        )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    return log_softmax_and_probs(logits)[0]


def kl_total(reference: np.ndarray, variant: np.ndarray) -> float:
    """The sum over positions of KL(softmax(reference) || softmax(variant)), logits [..., V], float64 in
    blocks of ROWS positions."""
    reference, variant = reference.reshape(-1, reference.shape[-1]), variant.reshape(-1, variant.shape[-1])
    total = 0.0
    for start in range(0, len(reference), ROWS):
        lr, pr = log_softmax_and_probs(reference[start : start + ROWS])
        total += float((pr * (lr - log_softmax(variant[start : start + ROWS]))).sum())
    return total


def log_softmax_and_probs(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 log-probabilities over the last axis, and the probabilities (one exp for both)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    total = e.sum(axis=-1, keepdims=True)
    x -= np.log(total)
    e /= total
    return x, e


class Evaluator:
    """Both models' ORT sessions, opened once; `compare` runs one set of windows through both."""

    def __init__(self, original: str | Path, fused: str | Path):
        self.paths = (Path(original), Path(fused))
        self.models = [ModelRun(p) for p in self.paths]

    def logits(self, k: int, ids: np.ndarray) -> np.ndarray:
        return self.models[k].logits(ids)

    def batch_size(self, wanted: int) -> int:
        """`wanted` windows per call, capped by a batch dim either model fixes (a flat model: 1)."""
        return min(m.signature.batch_size(wanted) for m in self.models)

    def check_window(self, window: int) -> None:
        for path, signature in zip(self.paths, (m.signature for m in self.models), strict=True):
            if signature.fixed_seq not in (None, window):
                raise UserError(f"{path} takes exactly {signature.fixed_seq} tokens: use --window "
                                f"{signature.fixed_seq}")

    def compare(self, text: TextSet, batch: int = 4, progress: bool = True) -> QualityResult:
        return self.sums(text, batch, progress).result(text.name)

    def sums(self, text: TextSet, batch: int = 4, progress: bool = True) -> _Sums:
        sums = _Sums()
        if text.windows.size:
            self.check_window(text.windows.shape[-1])
        step = self.batch_size(batch)
        bar = tqdm(
            total=len(text.windows),
            desc=f"evaluate {text.name}",
            unit="win",
            disable=not progress,
            leave=False,
        )
        for start in range(0, len(text.windows), step):
            ids = text.windows[start : start + step]
            a, b = self.logits(0, ids), self.logits(1, ids)
            if a.shape != b.shape:
                raise UserError(f"the models' logits differ in shape: {a.shape} vs {b.shape}")
            sums.add(ids, a, b)
            bar.update(len(ids))
        bar.close()
        return sums


def evaluate(
    original: str | Path,
    fused: str | Path,
    texts: Sequence[TextSet],
    batch: int = 4,
    progress: bool = True,
    log: Callable[[str], None] = lambda message: None,
) -> list[QualityResult]:
    """One result per text set, plus "all" (pooled over all positions) when there are several."""
    evaluator = Evaluator(original, fused)

    def each() -> Iterator[tuple[str, _Sums]]:
        for text in texts:
            files = ", ".join(text.files)
            log(f"{text.name}: {text.tokens} tokens in {len(text.windows)} windows from {files}")
            yield text.name, evaluator.sums(text, batch, progress)

    return _per_set_and_pooled(each())


def _per_set_and_pooled(sums: Iterable[tuple[str, _Sums]]) -> list[QualityResult]:
    """One result per text set, plus "all" (pooled over all positions) when there are several."""
    results, pooled = [], _Sums()
    for name, one in sums:
        results.append(one.result(name))
        pooled.merge(one)
    if len(results) > 1:
        results.append(pooled.result("all"))
    return results


def format_table(results: Sequence[QualityResult]) -> str:
    header = (
        f"{'text':<8} {'tokens':>7} {'ppl orig':>9} {'ppl fused':>9} {'top-1 agree':>11} "
        f"{'KL(o||f)':>9} {'cos':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.name:<8} {r.tokens:>7} {r.ppl_original:>9.3f} {r.ppl_fused:>9.3f} {r.top1_agreement:>11.4f} "
            f"{r.kl:>9.4f} {r.logits_cosine:>8.5f}"
        )
    return "\n".join(lines)


class ReferenceRun:
    """The original model's logits on text sets, run once and kept in `folder` (one float32 .npy per set,
    memory-mapped when read), so that many variants are compared with the original without running it
    again (tools/analyze.py --frontier). Files already in `folder` are reused: the caller keys the folder
    by the model and the texts."""

    def __init__(
        self, original: str | Path, texts: Sequence[TextSet], folder: Path, batch: int = 4,
        progress: bool = True, threads: int = 0,
    ):
        self.texts, self.batch, self.threads = list(texts), batch, threads
        folder.mkdir(parents=True, exist_ok=True)
        self.files = [folder / f"{k}-{t.name}.logits.npy" for k, t in enumerate(self.texts)]
        if all(f.exists() for f in self.files):
            return
        evaluator = ModelRun(original, threads)
        for text, file in zip(self.texts, self.files, strict=True):
            partial = file.with_suffix(".partial.npy")
            out = None
            step = evaluator.signature.batch_size(batch)
            for start in tqdm(range(0, len(text.windows), step), desc=f"original on {text.name}",
                              disable=not progress, leave=False):
                logits = evaluator.logits(text.windows[start : start + step])
                if out is None:
                    shape = (*text.windows.shape, logits.shape[-1])
                    out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=shape)
                out[start : start + len(logits)] = logits
            if out is not None:
                out.flush()
                del out
                partial.replace(file)  # complete files only: an interrupted run starts that set again

    def compare(self, variant: str | Path, progress: bool = True) -> list[QualityResult]:
        """One result per text set, plus "all" (pooled) when there are several, as `evaluate` gives."""
        model = ModelRun(variant, self.threads)

        def each() -> Iterator[tuple[str, _Sums]]:
            for text, file in zip(self.texts, self.files, strict=True):
                sums = _Sums()
                reference = np.load(file, mmap_mode="r") if text.windows.size else None
                step = model.signature.batch_size(self.batch)
                for start in tqdm(range(0, len(text.windows), step), desc=f"evaluate {text.name}",
                                  disable=not progress, leave=False):
                    ids = text.windows[start : start + step]
                    sums.add(ids, np.asarray(reference[start : start + len(ids)]), model.logits(ids))
                yield text.name, sums

        return _per_set_and_pooled(each())


class ModelRun:
    """One model's ORT session (`threads` 0: ONNX Runtime's default) and input signature."""

    def __init__(self, path: str | Path, threads: int = 0):
        path = Path(path)
        proto = load_proto(path)
        self.session = session(proto, path.parent, threads)
        self.signature = Signature.of(proto)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        out = self.session.run([self.signature.logits.name], self.signature.feeds(ids))[0]
        return out.reshape(*ids.shape, -1)
