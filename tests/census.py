"""How many tests exercise each stage on graphs other tools wrote and on every Nemotron-NAS block kind.

    python -m tests.census [PYTEST ARGS]      # e.g. -m "not slow" for the fast tier

Collects the suite (nothing runs) and counts each test once per (stage, source) it touches. The stage comes
from the test's module and name; the source from its fixtures, its parameters and the names its code
reads: a corpus entry (Optimum, ONNX Runtime GenAI fp32/int4, TorchScript, the ORT optimizer, dynamo),
a static-dims copy, or the every-kind Nemotron-NAS checkpoint. The table is what docs/journal compares
before and after a change to the suite.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections import Counter

import pytest

# First match wins: (pattern on "module::test", stage).
STAGES = (
    (r"show_blocks|model_map|patterns/|block_table", "recognize"),
    (r"analy[sz]|dependency|frontier|propose", "analyze"),
    (r"heal", "heal"),
    (r"fp8|quant", "fp8"),
    (r"shard|/tp/|tp2|tp4|tp8|gloo|all_?reduce", "tp"),
    (r"engine|tensorrt|trt", "engine"),
    (r"verify", "verify"),
    (r"serve|lm_eval|loading", "serve"),
    (r"decode|generate|genai_generator", "decode"),
    (r"checkpoint|nas_export|export_hf|prefill_graph", "checkpoint"),
    (r"prune", "prune"),
    (r"evaluat|quality", "evaluate"),
    (r"bench", "bench"),
    (r"fuse|parallel|plan|exact", "fuse"),
    (r"export", "export"),
)
SOURCES = {
    "optimum": r"optimum(?!-nopast)",
    "optimum-nopast": r"optimum-nopast",
    "genai-fp32": r"genai-fp32",
    "genai-int4": r"genai-int4|\bINT4\b",
    "torchscript": r"torchscript",
    "ort-optimizer": r"ort-optimizer|skip_norm|SkipSimplified",
    "dynamo": r"dynamo-(18|23)",
    "static dims": r"static_copy|fix_dims|static",
    "nemotron-nas all kinds": r"all_kinds|ALL_KINDS|write_all_kinds",
}


def stage_of(item: pytest.Item) -> str:
    where = f"{item.nodeid.split('[')[0]}".lower()
    for pattern, stage in STAGES:
        if re.search(pattern, where):
            return stage
    return "other"


def sources_of(item: pytest.Item) -> set[str]:
    text = item.nodeid
    with contextlib.suppress(OSError, TypeError, AttributeError):
        text += inspect.getsource(item.function)  # type: ignore[attr-defined]
    corpus = {"third_party_corpus", "corpus_hf"} & set(getattr(item, "fixturenames", ()))
    found = {name for name, pattern in SOURCES.items() if re.search(pattern, text)}
    if corpus and "[" in item.nodeid:  # a test parametrized over the corpus counts its own entry only
        entry = item.nodeid.split("[", 1)[1]
        found = {name for name, pattern in SOURCES.items() if re.search(pattern, entry)} or found
    return found


class _Collector:
    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.items = list(items)


def main(argv: list[str]) -> int:
    collector = _Collector()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *argv], plugins=[collector])
    if code not in (0, 5):
        return int(code)
    table: Counter[tuple[str, str]] = Counter()
    for item in collector.items:
        stage = stage_of(item)
        for source in sources_of(item):
            table[stage, source] += 1
    stages = sorted({s for s, _ in table})
    width = max(map(len, SOURCES))
    print(f"\n{len(collector.items)} tests collected\n")
    print(f"| {'source':{width}} | " + " | ".join(stages) + " |")
    print(f"| {'-' * width} | " + " | ".join("-" * len(s) for s in stages) + " |")
    for source in SOURCES:
        cells = [str(table[stage, source]).rjust(len(stage)) for stage in stages]
        print(f"| {source:{width}} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
