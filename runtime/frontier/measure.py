"""A plan measured whole: fused from the original (passes.pipeline.fuse_file) and compared with the original
on held-out text, the original's logits run once (ReferenceRun). A plan fused only to be measured is not
validated against the parallel-sum reference (the measurement itself compares it with the original; the
validation was 40% of a plan's time); a file a user keeps is (`fuse` here, fuse_onnx.py for the chosen
plan). ONNX Runtime runs on one thread: two threads spin on a busy machine for no gain in CPU time.
Results are kept in a cache folder keyed by the model's files and the text settings, one JSON file per
plan, so that a second run (another budget, another target) measures nothing again."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from passes.pipeline import fuse_file
from passes.plan import Plan
from runtime.evaluate import QualityResult, ReferenceRun
from runtime.text_sets import TextSet


@dataclass(frozen=True)
class Quality:
    """Held-out quality of a variant against the original (pooled over the text sets)."""

    kl: float
    ppl: float
    ppl_original: float
    top1: float
    positions: int
    seconds: float

    @classmethod
    def of(cls, result: QualityResult, seconds: float) -> Quality:
        return cls(result.kl, result.ppl_fused, result.ppl_original, result.top1_agreement, result.tokens,
                   round(seconds, 2))


def model_key(model: Path) -> str:
    """The model's files (the .onnx and its external data beside it, by name, size and mtime)."""
    files = sorted(p for p in model.parent.iterdir() if p.name.startswith(model.name))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps([str(model.resolve()), stats]).encode()).hexdigest()[:16]


def texts_key(texts: list[TextSet]) -> str:
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.name.encode())
        digest.update(np.ascontiguousarray(t.windows).tobytes())
    return digest.hexdigest()[:16]


def plan_key(plan: Plan) -> str:
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


class PlanMeasurer:
    """Measures plans of one model on one held-out text, caching each result under `cache`."""

    def __init__(self, model: Path, texts: list[TextSet], cache: Path, workdir: Path, progress: bool = True):
        self.model, self.workdir, self.progress = model, workdir, progress
        self.folder = cache / f"{model_key(model)}-{texts_key(texts)}"
        self.texts = texts
        self._reference: ReferenceRun | None = None

    @property
    def reference(self) -> ReferenceRun:
        if self._reference is None:  # the original runs only when some plan is not cached
            folder = self.folder / "original"
            self._reference = ReferenceRun(self.model, self.texts, folder, progress=self.progress, threads=1)
        return self._reference

    def cached(self, plan: Plan) -> Quality | None:
        file = self.folder / "plans" / f"{plan_key(plan)}.json"
        if not file.exists():
            return None
        data = json.loads(file.read_text())
        return Quality(**data["quality"]) if data.get("plan") == json.loads(plan.to_json()) else None

    def fuse(self, plan: Plan, path: Path) -> Path:
        """The plan's fused model written to `path`, validated as every fusion is."""
        fuse_file(self.model, plan, path, validate_output=True)
        return path

    def measure(self, plan: Plan) -> Quality:
        """The plan's quality: from the cache when there, else fused into the work folder, measured and
        removed."""
        found = self.cached(plan)
        if found is not None:
            return found
        start = time.perf_counter()
        path = self.workdir / "variant.onnx"
        fuse_file(self.model, plan, path, validate_output=False)
        try:
            quality = Quality.of(self.reference.compare(path, self.progress)[-1], time.perf_counter() - start)
        finally:
            for p in path.parent.glob(path.name + "*"):
                p.unlink()
        file = self.folder / "plans" / f"{plan_key(plan)}.json"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({"plan": json.loads(plan.to_json()), "quality": asdict(quality)}) + "\n")
        return quality

    def quality_of(self, variant: Path) -> Quality:
        """A model written elsewhere (a healed plan) against the same original and text."""
        start = time.perf_counter()
        return Quality.of(self.reference.compare(variant, self.progress)[-1], time.perf_counter() - start)
