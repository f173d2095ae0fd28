"""Run an ONNX graph the way every check of the suite does: one helper instead of one per test file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from passes.graph_inputs import Signature
from passes.io.sessions import open_session


def graph_logits(path: str | Path, ids: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """The graph's logits for `ids` ([batch, seq]); every other input as Signature.feeds makes it (an
    all-ones mask, positions from 0, empty caches). External data is read beside `path`."""
    session = open_session(path, threads=threads)
    signature = Signature.of(Path(path))  # from the graph: it knows cache dims the session leaves symbolic
    return session.run([signature.logits.name], signature.feeds(ids))[0]
