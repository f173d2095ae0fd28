"""The third-party export corpus (tests/corpora/third_party.py) as pytest fixtures, and its torch reference.

Fixtures (import them into a test module: `from corpus import third_party_corpus, corpus_hf  # noqa: F401`):

- `third_party_corpus`: {entry name: model.onnx path} for every entry of tests.corpora.third_party.ENTRIES
  (optimum, optimum-nopast, genai-fp32, genai-int4, torchscript-17, ort-optimizer, dynamo-18, dynamo-23);
  SmolLM2-135M with attention dropped from blocks 13-22, 30 blocks each.
- `corpus_hf`: the Hugging Face folder they were exported from (o_proj of layers 13-22 zero, so the
  folder loaded by transformers is their exact torch reference).

Cache: built once into $FFN_FUSION_CORPUS or ~/.cache/ffn-fusion/corpus-v<CORPUS_VERSION> (a child
process runs `python -m tests.corpora.third_party`; the Optimum venv .venv-optimum is made on demand), and
reused by later sessions and runs. Treat the files as read-only: write fused models under tmp_path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

from tests.corpora.third_party import DROPPED, ENTRIES, corpus_dir, entry_path

# The plan the corpus tests fuse: two groups inside the attention-free run 13-22.
GROUPS = ((13, 17), (18, 21))


def build() -> Path:
    folder = corpus_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):  # one pytest-xdist worker builds, the other waits for it
        if not all(entry_path(folder, name).exists() for name in ENTRIES):
            _run_build(folder)
    return folder


def _run_build(folder: Path) -> None:
    command = [sys.executable, "-m", "tests.corpora.third_party", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        raise RuntimeError(f"building the corpus failed:\n{output}")


@pytest.fixture(scope="session")
def third_party_corpus() -> dict[str, Path]:
    folder = build()
    return {name: entry_path(folder, name) for name in ENTRIES}


@pytest.fixture(scope="session")
def corpus_hf(third_party_corpus) -> Path:
    return corpus_dir() / "hf"


def expected_attention() -> list[bool]:
    return [i not in DROPPED for i in range(30)]


def torch_logits(hf: Path, ids: np.ndarray, groups=(), mode: str = "last") -> np.ndarray:
    """Logits of the folder's model in torch, each group [i, j] replaced by its parallel sum
    x + sum_k mlp_k(norm(x)) (tests/torch_reference.py): independent of the ONNX rewrite."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only the corpus reference needs it)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the corpus reference needs it)

    from tests.torch_reference import parallel_model  # noqa: PLC0415 (imports torch: only the corpus reference needs it)

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    parallel_model(model, groups, mode)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
