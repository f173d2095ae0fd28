"""Start copying the weights before the graph libraries load: a guess of the checkpoint's tensors, made
from light inputs only, written in a second thread while the main thread imports onnx_ir and numpy, loads
the graph and recognizes it (~1 s of CPU at 92 layers).

The guess (no onnx_ir, no recognizer, not even `onnx`): config.json of the source gives the output layers
and their tensors; the ONNX protobuf, read by exporters.nas.onnx_proto (standard library only, a few ms),
gives each initializer's place in the data file; the names are the ones the --hf exporter and
passes/fuse.py write (`model.layers.N.*` by checkpoint name, a fused group's
`ffn_fusion.{i}_{j}.{gate,up,down}_proj.weight`, its "last" norm the group's last FFN norm, a "fold" norm
ones). Only kernel copies are guessed (weights in the output dtype, stored [out, in]); anything else and
there is no guess. exporters.nas.export then builds the real list through the recognizer
(exporters.nas.layout) and keeps what the thread wrote only when every tensor's name, dtype, shape and
byte range agrees with the guess; otherwise it stops the thread and writes the checkpoint again. So the
guess decides only how early the copy starts, never what is written.
"""

from __future__ import annotations

import contextlib
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from exporters.hf.config import HfConfig, expected_tensors
from exporters.nas.onnx_proto import EXTERNAL, Initializer, read_model
from exporters.nas.safetensors_out import OutTensor, copied, filled_with_ones, in_memory, write_checkpoint
from passes.errors import UserError
from passes.metadata import HF_METADATA_KEY, recorded_plan
from passes.plan import Plan

_ATTENTION = ("input_layernorm.", "self_attn.")


@dataclass
class EarlyCopy:
    """The guessed tensors and the thread writing them into the staging folder."""

    tensors: list[OutTensor]
    writing: Future
    stop: threading.Event
    pool: ThreadPoolExecutor

    def matches(self, tensors: list[OutTensor]) -> bool:
        """The real tensor list is the guess: same names, dtypes, shapes and byte origins, in order."""
        def key(t: OutTensor) -> tuple:
            return t.name, t.dtype, t.shape, t.origin

        return len(tensors) == len(self.tensors) and all(
            t.origin is not None and key(t) == key(g) for t, g in zip(tensors, self.tensors, strict=True)
        )

    def finish(self) -> list:
        try:
            return self.writing.result()
        finally:
            self.pool.shutdown()

    def cancel(self) -> None:
        """Stop after the current tensor and wait for the thread (its files are then removed)."""
        self.stop.set()
        with contextlib.suppress(Exception):  # a failed guess is discarded with its files
            self.writing.result()
        self.pool.shutdown()


def start(
    onnx_path: Path, source: HfConfig, dtype: str, staging: Path, max_shard_bytes: int
) -> EarlyCopy | None:
    """Guess the tensors and start writing them into `staging`; None when there is no guess."""
    tensors = guess(onnx_path, source, dtype)
    if tensors is None:
        return None
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    writing = pool.submit(write_checkpoint, staging, tensors, max_shard_bytes, lambda message: None, stop)
    return EarlyCopy(tensors, writing, stop, pool)


def guess(onnx_path: Path, source: HfConfig, dtype: str) -> list[OutTensor] | None:
    """The checkpoint's tensors as the names say they are, or None (not all are kernel copies)."""
    try:
        header = read_model(onnx_path)
    except Exception:  # noqa: BLE001 - the real path reports the problem in its own words
        return None
    meta = header.metadata
    try:
        json.loads(meta[HF_METADATA_KEY])
        plan = recorded_plan(meta) or Plan()
    except (KeyError, ValueError, UserError):
        return None
    if plan.parallel or source.architecture not in ("LlamaForCausalLM", "DeciLMForCausalLM"):
        return None
    table = header.initializers
    names = expected_tensors(source)
    groups = dict(plan.groups)
    # (output name, the initializer holding it or None for ones, shape)
    order: list[tuple[str, str | None, tuple[int, ...]]] = []
    head = [n for n in names if not n.startswith("model.layers.")]
    order.append((head[0], head[0], names[head[0]][0]))
    out, i = 0, 0
    while i < len(source.layers):
        last, to = groups.get(i, i), f"model.layers.{out}."
        own = {n[len(f"model.layers.{i}.") :]: (n, s) for n, (s, _) in names.items()
               if n.startswith(f"model.layers.{i}.")}  # this layer's tensors by their name in the layer
        order += [(to + part, n, s) for part, (n, s) in own.items() if part.startswith(_ATTENTION)]
        if last > i:
            members = [k for k in range(i, last + 1) if source.layers[k].ffn == "swiglu"]
            width, hidden = sum(source.layers[k].ffn_width for k in members), source.hidden
            last_norm = f"model.layers.{members[-1]}.post_attention_layernorm.weight"
            norm = last_norm if plan.norm == "last" else None
            order.append((f"{to}post_attention_layernorm.weight", norm, (hidden,)))
            shapes = {"gate": (width, hidden), "up": (width, hidden), "down": (hidden, width)}
            for role, shape in shapes.items():
                fused = f"ffn_fusion.{i}_{last}.{role}_proj.weight"
                order.append((f"{to}mlp.{role}_proj.weight", fused, shape))
        else:
            order += [(to + part, n, s) for part, (n, s) in own.items() if not part.startswith(_ATTENTION)]
        out, i = out + 1, last + 1
    order += [(n, n, names[n][0]) for n in head[1:]]
    tensors = []
    for out_name, init, shape in order:
        if init is None:
            tensors.append(filled_with_ones(out_name, dtype, shape))
            continue
        tensor = table.get(init)
        if _inline(tensor, shape, dtype):
            tensors.append(in_memory(out_name, dtype, shape, tensor.raw_data))
            continue
        place = _place(tensor, shape, dtype, onnx_path.parent)
        if place is None:
            return None
        tensors.append(copied(out_name, dtype, shape, *place))
    return tensors


def _inline(tensor: Initializer | None, shape: tuple[int, ...], dtype: str) -> bool:
    """A small initializer stored in the ONNX file itself as raw bytes, in `shape` and `dtype`."""
    return (
        tensor is not None
        and tensor.data_location != EXTERNAL
        and bool(tensor.raw_data)
        and tuple(tensor.dims) == shape
        and tensor.dtype == dtype
    )


def _place(tensor: Initializer | None, shape: tuple[int, ...], dtype: str, folder: Path):
    """(file, offset, length) of an external initializer stored as `shape` in `dtype`, else None."""
    if tensor is None or tensor.data_location != EXTERNAL:
        return None
    if tuple(tensor.dims) != shape or tensor.dtype != dtype:
        return None
    info = tensor.external
    if "location" not in info or "length" not in info:
        return None
    return str(folder / info["location"]), int(info.get("offset", 0)), int(info["length"])
