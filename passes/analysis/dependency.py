"""Numeric analysis of a decoder's blocks with ONNX Runtime (paper sections 3 and 5.4).

Definitions (all means are over tokens; "cos" is the cosine over the hidden dimension of one token):

- dependency[i][j] (i < j): mean of 1 - cos(h_j, h~_j), where h_j is block j's output minus its input in
  the unchanged model and h~_j the same with block i skipped entirely (attention and FFN); None where
  i >= j. A pair of zero vectors counts as distance 0.
- io_cosine_distance: mean of 1 - cos(block input, block output);
- residual_norm_ratio: mean of ||output - input|| / ||input||.
Block input is the residual stream entering the block (before its attention), block output the stream
after its FFN's residual add.

How: the graph is cut into one subgraph per block. A block's subgraph reads the stream entering it and
the side tensors it needs that are computed outside it (rotary cos/sin, the attention mask, shapes);
the side tensors are captured once from a full run of the model with extra outputs, and stay fixed
when a block is skipped (they do not depend on the residual stream; this is checked). Skipping block i
does not change the stream before it, so row i starts from the stored input of block i and runs blocks
i+1..N-1 forward: N(N-1)/2 block evaluations for the whole matrix, plus N for the unchanged chain.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from tqdm import tqdm

from passes.blocks import Block
from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.io.model_io import load_model, load_proto, weight_bytes
from passes.io.sessions import open_session
from passes.model_map import find_blocks, vocab_size
from passes.reference import ffn_weight_bytes, parallel_sum

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.DOUBLE,
}
# The block-by-block chain must reproduce the whole model's last stream to this relative error.
CHAIN_TOLERANCE = 1e-3
# Ops whose output depends only on their input's shape: skipping a block does not change it.
SHAPE_ONLY_OPS = {"Shape", "Size"}
# Fused add + norm (ONNX Runtime contrib ops): output 0 is the normalized sum, output 3 the sum (the stream).
SKIP_NORMS = {
    "SkipSimplifiedLayerNormalization": "SimplifiedLayerNormalization",
    "SkipLayerNormalization": "LayerNormalization",
}
# Above this many bytes of weights a BlockRunner streams: one block's weights in memory at a time.
STREAMING_BYTES = 3 << 30
# model_logits, streaming: a block whose FFN holds more than this (a fused group's) is evaluated from its
# weights a row block at a time in float64 (passes/reference.py), not loaded into a session.
LARGE_FFN_BYTES = 256 << 20


def session(
    proto: onnx.ModelProto, folder: Path, threads: int = 0, prepack: bool = True
) -> ort.InferenceSession:
    """An ONNX Runtime CPU session for `proto` whose external data (if any) lies in `folder`."""
    return open_session(proto, folder=folder, threads=threads or None, prepack=prepack)


def input_feed(proto: onnx.ModelProto, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds for every graph input (passes/graph_inputs.py): the token ids ([batch, seq], or [seq] for flat
    models), and for Optimum/GenAI/decode graphs an all-ones mask, positions and an empty KV cache."""
    return Signature.of(proto).feeds(tokens)


# ---------------------------------------------------------------------------------------------- graph cut


@dataclass
class BlockCut:
    """One block as a subgraph: stream in -> stream out, with side tensors captured from a full run."""

    index: int
    attention: bool
    width: int
    input_name: str
    output_name: str
    side_inputs: list[str]
    proto: onnx.ModelProto


class _Graph:
    """Name-level view of an ONNX graph: producers, consumers, initializers, value types."""

    def __init__(self, proto: onnx.ModelProto):
        graph = proto.graph
        self.nodes = list(graph.node)
        self.producer = {out: k for k, node in enumerate(self.nodes) for out in node.output if out}
        self.consumers: dict[str, list[int]] = {}
        for k, node in enumerate(self.nodes):
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(k)
        self.initializers = {t.name for t in graph.initializer}
        self.graph_inputs = {v.name for v in graph.input}

    def forward_cone(self, start: str, values_only: bool = False) -> set[str]:
        """Names of all values computed from `start` (including it). With `values_only`, only through edges
        that carry values: not into Shape/Size nor CastLike's type input (skipping a block keeps shapes)."""
        seen, frontier = {start}, [start]
        while frontier:
            name = frontier.pop()
            for k in self.consumers.get(name, []):
                if values_only and not _reads_values(self.nodes[k], name):
                    continue
                for out in self.nodes[k].output:
                    if out and out not in seen:
                        seen.add(out)
                        frontier.append(out)
        return seen

    def block_side_inputs(self, start: str, end: str) -> list[str]:
        """Values the block start -> end reads that it does not compute from `start` (initializers aside)."""
        dependent = self.forward_cone(start)
        if end not in dependent:
            raise UserError(f"block output {end!r} is not computed from its input {start!r}")
        side, seen, frontier = [], {end}, [end]
        while frontier:
            node = self.nodes[self.producer[frontier.pop()]]
            for name in node.input:
                if not name or name in seen or name == start or name in self.initializers:
                    continue
                seen.add(name)
                if name in dependent:
                    frontier.append(name)
                else:
                    side.append(name)
        return sorted(side)


def _reads_values(node: onnx.NodeProto, name: str) -> bool:
    """Whether `node` reads the values of input `name` (not only its shape or type)."""
    if node.op_type in SHAPE_ONLY_OPS:
        return False
    return not (node.op_type == "CastLike" and name not in node.input[:1])


def _typed_proto(path: Path) -> onnx.ModelProto:
    """The model proto (external data left on disk) with value types from shape inference."""
    proto = load_proto(path)
    try:
        return onnx.shape_inference.infer_shapes(proto)
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return proto


def _value_types(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    graph = proto.graph
    return {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}


def _proto_node(graph: _Graph, node: ir.Node) -> onnx.NodeProto:
    """The proto node of the onnx_ir node `node` (matched by op type and input names)."""
    inputs = [v.name if v is not None else "" for v in node.inputs]
    for candidate in graph.nodes:
        if candidate.op_type == node.op_type and list(candidate.input)[: len(inputs)] == inputs:
            return candidate
    raise UserError(f"internal error: node {node.name!r} not found in the model proto")


def stream_names(proto: onnx.ModelProto, blocks: list[Block]) -> list[tuple[str, str]]:
    """(input, output) stream names of every block. A last block whose residual sum the final
    Skip*Normalization keeps internal (output 3 unnamed) gets that output named in `proto`."""
    names = [
        (b.block_input.name, b.residual.output.name if b.residual.output is not None else "") for b in blocks
    ]
    if not names[-1][1]:
        graph = _Graph(proto)
        node = _proto_node(graph, blocks[-1].residual.node)
        if node.op_type not in SKIP_NORMS:
            raise UserError(f"internal error: the last block's residual {node.op_type} has no output")
        sum_name = f"{node.name or node.output[0]}/residual_sum"
        while len(node.output) < 4:
            node.output.append("")
        node.output[3] = sum_name
        names[-1] = (names[-1][0], sum_name)
    return names


def split_skip_norms(proto: onnx.ModelProto, starts: list[str]) -> None:
    """A block that starts at a Skip*Normalization's sum (output 3) also reads its normalized output 0,
    which the same node computes from the previous block's values. Give such a block its own norm:
    consumers of output 0 read a plain (Simplified)LayerNormalization of the sum instead (same weights)."""
    graph = _Graph(proto)
    for start in starts:
        k = graph.producer.get(start)
        node = graph.nodes[k] if k is not None else None
        if node is None or node.op_type not in SKIP_NORMS or len(node.output) < 4 or start != node.output[3]:
            continue
        normalized = node.output[0]
        if not graph.consumers.get(normalized):
            continue
        block_norm = f"{normalized}/block_norm"
        attrs = [a for a in node.attribute if a.name == "epsilon"]
        beta = node.input[3:4] if node.op_type == "SkipLayerNormalization" else []  # Simplified: 3 is a bias
        inputs = [start, node.input[2], *[b for b in beta if b]]
        norm = onnx.helper.make_node(SKIP_NORMS[node.op_type], inputs, [block_norm], name=block_norm, axis=-1)
        norm.attribute.extend(attrs)
        for j in graph.consumers[normalized]:
            consumer = graph.nodes[j]
            for slot, name in enumerate(consumer.input):
                if name == normalized:
                    consumer.input[slot] = block_norm
        proto.graph.node.insert(k + 1, norm)
        graph = _Graph(proto)


def cut_blocks(path: Path, blocks: list[Block], proto: onnx.ModelProto) -> list[BlockCut]:
    """One subgraph per block (onnx.utils.Extractor on the proto; weights stay where they are).

    Stream tensors whose type shape inference left unknown get the embedding output's type in `proto`;
    fused Skip*Normalization nodes at block boundaries are split in `proto` (see split_skip_norms).
    """
    names = stream_names(proto, blocks)
    split_skip_norms(proto, [start for start, _ in names[1:]])
    graph = _Graph(proto)
    stream = graph.forward_cone(names[0][0], values_only=True)
    sides = []
    for k, (start, end) in enumerate(names):
        if k + 1 < len(blocks) and names[k + 1][0] != end:
            raise UserError(f"block {k + 1} does not start where block {k} ends; cannot analyze this graph")
        sides.append(graph.block_side_inputs(start, end))
    _check_side_inputs(blocks, sides, stream, _value_types(proto))
    _fill_stream_types(proto, [start for start, _ in names] + [names[-1][1]])
    types = _value_types(proto)
    extractor = onnx.utils.Extractor(proto)
    cuts = []
    for block, side, (start, end) in zip(blocks, sides, names, strict=True):
        unknown = [name for name in side if name not in types]
        if unknown:
            raise UserError(
                f"block {block.index}: the type of {unknown[0]!r} is unknown (shape inference failed)"
            )
        sub = extractor.extract_model([start, *side], [end])
        cuts.append(BlockCut(block.index, block.attention, block.width, start, end, side, sub))
    return cuts


def _check_side_inputs(blocks: list[Block], sides: list[list[str]], stream: set[str], types: dict) -> None:
    """Side tensors stay fixed when a block is skipped: they must not be computed from the stream
    (integer shape tensors are allowed: skipping a block does not change shapes)."""
    for block, side in zip(blocks, sides, strict=True):
        for name in side:
            known = types.get(name)
            elem = known.type.tensor_type.elem_type if known is not None else onnx.TensorProto.FLOAT
            if name in stream and elem in FLOAT_TYPES:
                raise UserError(
                    f"block {block.index} reads {name!r}, computed from the residual stream outside the "
                    "block (a norm shared across blocks, e.g. SkipSimplifiedLayerNormalization?); "
                    "dependency analysis needs blocks that read only their input stream"
                )


def _fill_stream_types(proto: onnx.ModelProto, names: list[str]) -> None:
    """Stream values (`names`, the first one the first block's input) without a type get the first's."""
    types = _value_types(proto)
    first = types.get(names[0])
    elem = first.type.tensor_type.elem_type if first is not None else onnx.TensorProto.FLOAT
    for name in names:
        if name not in types:
            proto.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem, None))


# ---------------------------------------------------------------------------------------------- running


class BlockRunner:
    """Runs a decoder whole (capturing streams and side tensors) or block by block."""

    def __init__(
        self,
        model_path: str | Path,
        threads: int = 0,
        streaming: bool | None = None,
        large_ffn_bytes: int | None = None,
    ):
        self.path = Path(model_path)
        model = load_model(self.path)
        self.blocks = find_blocks(model)
        self.proto = _typed_proto(self.path)
        self.cuts = cut_blocks(self.path, self.blocks, self.proto)
        self.threads = threads
        # Streaming (models larger than RAM; default: above STREAMING_BYTES of weights): at most one block's
        # weights are loaded at a time, and captures run block by block instead of as one whole model.
        self.streaming = weight_bytes(model) > STREAMING_BYTES if streaming is None else streaming
        del model
        self._sessions: dict[int, ort.InferenceSession] = {}
        self._attention: dict[int, tuple[list[str], ort.InferenceSession]] = {}
        self.side: dict[str, np.ndarray] = {}
        self.logits: np.ndarray | None = None
        self._tail: tuple[list[str], onnx.ModelProto] | None = None
        # Streaming: blocks with more FFN weight bytes than this run through the row-block reference.
        self.large_ffn_bytes = large_ffn_bytes

    @property
    def vocab(self) -> int:
        return vocab_size(self.blocks)

    def block_session(self, k: int) -> ort.InferenceSession:
        if k not in self._sessions:
            if self.streaming:
                self._sessions.clear()  # release the previous block's weights before loading these
                self._attention.clear()
                # No prepacked second copy of the weights (measured in docs/scale.md: the peak halves).
                self._sessions[k] = session(self.cuts[k].proto, self.path.parent, self.threads, prepack=False)
            else:
                self._sessions[k] = session(self.cuts[k].proto, self.path.parent, self.threads)
                self.cuts[k].proto = onnx.ModelProto()  # the session holds the weights now
        return self._sessions[k]

    def _stream_names(self) -> list[str]:
        return [c.input_name for c in self.cuts] + [self.cuts[-1].output_name]

    def _side_names(self, tail: bool) -> list[str]:
        """The side tensors a streaming capture needs: the blocks' and, with `tail`, the tail's."""
        tail_sides = self._tail_cut()[0] if tail else []
        return sorted({n for c in self.cuts for n in c.side_inputs} | set(tail_sides))

    def _tail_cut(self) -> tuple[list[str], onnx.ModelProto]:
        """The graph after the last block: its side inputs and the subgraph last stream -> logits (the final
        norm and the lm_head; one matrix of weights). A final Skip*Normalization whose sum ends the last
        block is split first (split_skip_norms), so that its norm reads the stream."""
        if self._tail is None:
            last, logits = self.cuts[-1].output_name, self.proto.graph.output[0].name
            split_skip_norms(self.proto, [last])
            side = _Graph(self.proto).block_side_inputs(last, logits)
            self._tail = (side, onnx.utils.Extractor(self.proto).extract_model([last, *side], [logits]))
        return self._tail

    def _prefix(self, sides: list[str]) -> ort.InferenceSession:
        """The graph from its inputs to the first block's input and every side tensor (the embedding,
        rotary tables, masks): what a streaming capture runs before the blocks."""
        inputs = [v.name for v in self.proto.graph.input]
        sub = onnx.utils.Extractor(self.proto).extract_model(inputs, [self.cuts[0].input_name, *sides])
        produced = {out for node in sub.graph.node for out in node.output}
        if any(c.output_name in produced for c in self.cuts):
            raise UserError("a side tensor of a block depends on a later block; cannot stream this model")
        return session(sub, self.path.parent, self.threads)

    def _capture_streaming(
        self, tokens: np.ndarray, extra: Iterable[str], only: bool
    ) -> dict[str, np.ndarray]:
        """capture() block by block: the prefix, then each block's subgraph, one block loaded at a time."""
        extra = set(extra)
        feed = input_feed(self.proto, tokens)
        sides = self._side_names(tail=not only)
        prefix = self._prefix(sides)
        values = prefix.run(None, feed)
        del prefix
        outputs = dict(zip([self.cuts[0].input_name, *sides], values, strict=True))
        self.side = {n: outputs[n] for n in sides}
        attention_inputs = {b.ffn_input.name: b.index for b in self.blocks if b.attention}
        streams = {c.input_name for c in self.cuts} | {c.output_name for c in self.cuts}
        unknown = extra - streams - set(attention_inputs) - set(sides)
        if unknown:
            raise UserError(f"a streaming capture keeps block streams only, not {sorted(unknown)[0]!r}")
        last = len(self.cuts) - 1
        if only:
            needed = [k for k, c in enumerate(self.cuts) if {c.input_name, c.output_name} & extra]
            needed += [attention_inputs[n] for n in extra & set(attention_inputs)]
            last = max(needed, default=-1)
        x = outputs[self.cuts[0].input_name]
        for k in range(last + 1):
            block = self.blocks[k]
            if block.attention and block.ffn_input.name in extra:
                outputs[block.ffn_input.name] = self.run_attention(k, x)
            x = outputs[self.cuts[k].output_name] = self.run_block(k, x)
        self._sessions.clear()
        self._attention.clear()
        self.logits = None if only else self._run_tail(x)
        outputs.update(feed)
        return outputs

    def _run_tail(self, stream: np.ndarray) -> np.ndarray:
        side, proto = self._tail_cut()
        tail = session(proto, self.path.parent, self.threads, prepack=False)
        feed = {self.cuts[-1].output_name: stream, **{n: self.side[n] for n in side}}
        return np.array(tail.run(None, feed)[0])

    def capture(
        self, tokens: np.ndarray, extra: Iterable[str] = (), only: bool = False
    ) -> dict[str, np.ndarray]:
        """Run the whole model once; keep logits, every block's input/output, all side tensors and the
        `extra` values (e.g. the stream entering a block's FFN, after its attention). With `only`, keep
        just the side tensors and `extra` (no logits): ONNX Runtime then skips the blocks after the last
        value asked for, and the lm_head. Streaming runners never hold the whole model: they run the prefix,
        each block and the tail (final norm and lm_head) one after the other."""
        if self.streaming:
            return self._capture_streaming(tokens, extra, only)
        proto = self.proto
        _fill_stream_types(proto, [*self._stream_names(), *extra])
        types = _value_types(proto)
        feed = input_feed(proto, tokens)
        saved = list(proto.graph.output)
        existing = [] if only else [o.name for o in saved]
        names = set(extra) | {n for c in self.cuts for n in c.side_inputs}
        if not only:
            names |= {c.input_name for c in self.cuts} | {c.output_name for c in self.cuts}
        wanted = sorted(names - set(feed) - set(existing))
        if only:
            del proto.graph.output[:]
        proto.graph.output.extend(types[n] for n in wanted)  # temporarily: the proto holds the weights
        try:
            sess = session(proto, self.path.parent, self.threads)
        finally:
            del proto.graph.output[:]
            proto.graph.output.extend(saved)
        values = sess.run(None, feed)
        del sess
        outputs = dict(zip(existing + wanted, values, strict=True))
        outputs.update(feed)
        self.side = {n: outputs[n] for c in self.cuts for n in c.side_inputs}
        self.logits = None if only else outputs[existing[0]]
        return outputs

    def close(self) -> None:
        """Drop the sessions and subgraphs (their weights) once the analysis is done."""
        self._sessions.clear()
        self._attention.clear()
        self.cuts = []
        self.proto = onnx.ModelProto()
        self._tail = None

    def run_attention(self, k: int, stream: np.ndarray) -> np.ndarray:
        """The stream entering block k's FFN (after its attention sub-block) for block input `stream`."""
        if k not in self._attention:
            block = self.blocks[k]
            start, end = block.block_input.name, block.ffn_input.name
            side = _Graph(self.proto).block_side_inputs(start, end)
            _fill_stream_types(self.proto, [*self._stream_names(), end])
            sub = onnx.utils.Extractor(self.proto).extract_model([start, *side], [end])
            if self.streaming:  # release the loaded block first
                self._sessions.clear()
                self._attention.clear()
            self._attention[k] = (side, session(sub, self.path.parent, self.threads))
        side, sess = self._attention[k]
        feed = {self.cuts[k].input_name: stream, **{n: self.side[n] for n in side}}
        return np.array(sess.run(None, feed)[0])  # a copy: see run_block

    def run_block(self, k: int, stream: np.ndarray) -> np.ndarray:
        """Block k's output stream for input `stream` (side tensors from the last capture)."""
        if self.streaming and self.large_ffn_bytes is not None:
            block = self.blocks[k]
            if ffn_weight_bytes(block) > self.large_ffn_bytes:
                # A fused group's block can hold a whole group of weights: evaluate its FFN in float64
                # from its weights a row block at a time (passes/reference.py) instead of loading them.
                x = self.run_attention(k, stream) if block.attention else stream
                return parallel_sum(x, [block], "last").astype(stream.dtype)
        cut = self.cuts[k]
        feed = {cut.input_name: stream, **{n: self.side[n] for n in cut.side_inputs}}
        # A copy: ONNX Runtime's output array keeps the memory of the run it came from (the session's arena)
        # alive after the session is released; the analysis keeps every block's streams.
        return np.array(self.block_session(k).run(None, feed)[0])


def model_logits(model_path: str | Path, tokens: np.ndarray, threads: int = 0) -> np.ndarray:
    """The model's first output (logits) on `tokens`: one whole-model session, or above STREAMING_BYTES of
    weights block by block (BlockRunner streaming), so that a model larger than RAM is never loaded whole."""
    path = Path(model_path)
    proto = load_proto(path)
    if weight_bytes(ir.serde.deserialize_model(proto)) <= STREAMING_BYTES:  # sizes only: no data is read
        return session(proto, path.parent, threads).run(None, input_feed(proto, tokens))[0]
    # A fused model's block may hold a whole group's weights: above LARGE_FFN_BYTES, the row-block reference.
    runner = BlockRunner(path, threads, streaming=True, large_ffn_bytes=LARGE_FFN_BYTES)
    runner.capture(tokens)
    return runner.logits


# ---------------------------------------------------------------------------------------------- metrics


def _rows(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1])


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over tokens of 1 - cos(a_t, b_t); a pair of zero vectors counts as 0."""
    a, b = _rows(a), _rows(b)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dots = np.einsum("td,td->t", a, b)
    both_zero = (na == 0) & (nb == 0)
    cos = np.where(both_zero, 1.0, dots / np.maximum(na * nb, 1e-300))
    return float(np.mean(np.clip(1.0 - cos, 0.0, 2.0)))  # clip: rounding of identical vectors


def norm_ratio(delta: np.ndarray, x: np.ndarray) -> float:
    """Mean over tokens of ||delta_t|| / ||x_t||."""
    return float(
        np.mean(np.linalg.norm(_rows(delta), axis=1) / np.maximum(np.linalg.norm(_rows(x), axis=1), 1e-300))
    )


@dataclass
class BlockStats:
    index: int
    attention: bool
    ffn_width: int
    io_cosine_distance: float
    residual_norm_ratio: float

    def row(self) -> dict:
        return {
            "index": self.index,
            "attention": self.attention,
            "ffn_width": self.ffn_width,
            "io_cosine_distance": self.io_cosine_distance,
            "residual_norm_ratio": self.residual_norm_ratio,
        }


@dataclass
class Analysis:
    blocks: list[BlockStats]
    dependency: np.ndarray  # N x N, NaN where i >= j
    tokens: int
    seconds: float
    block_evaluations: int
    chain_rel_error: float  # block-by-block chain vs whole-model run, last stream
    extra: dict = field(default_factory=dict)

    def dependency_json(self) -> list[list[float | None]]:
        return [[None if np.isnan(v) else float(v) for v in row] for row in self.dependency]

    def to_json(self) -> dict:
        return {
            "blocks": [b.row() for b in self.blocks],
            "dependency": self.dependency_json(),
            "tokens": self.tokens,
            "seconds_block_evaluations": round(self.seconds, 2),
            "block_evaluations": self.block_evaluations,
            "chain_rel_error": self.chain_rel_error,
            **self.extra,
        }


def analyze(
    model_path: str | Path,
    tokens: np.ndarray,
    rows: Iterable[int] | None = None,
    progress: bool = True,
    runner: BlockRunner | None = None,
) -> Analysis:
    """Block statistics and the dependency matrix of the model at `model_path` on `tokens` ([batch, seq]).

    `rows` limits which rows i of the matrix are computed (default: all); others stay NaN.
    """
    start = time.perf_counter()
    runner = runner or BlockRunner(model_path)
    n = len(runner.blocks)
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size == 0:
        raise UserError("no tokens to analyze")
    if tokens.min() < 0 or tokens.max() >= runner.vocab:
        raise UserError(f"token ids must lie in 0..{runner.vocab - 1} (the model's vocabulary)")
    captured = runner.capture(tokens)
    rows = list(range(n)) if rows is None else sorted(set(rows))
    total = n + sum(n - 1 - i for i in rows)
    bar = tqdm(total=total, desc="block evaluations", unit="blk", disable=not progress, leave=False)
    # The unchanged chain, block by block, from the embedding output.
    inputs, outputs, deltas = [], [], []
    x = captured[runner.cuts[0].input_name]
    for k in range(n):
        y = runner.run_block(k, x)
        inputs.append(x)
        outputs.append(y)
        deltas.append(y - x)
        x = y
        bar.update()
    whole = captured[runner.cuts[-1].output_name]
    chain_error = float(np.linalg.norm(x.astype(np.float64) - whole) / max(np.linalg.norm(whole), 1e-30))
    if chain_error > CHAIN_TOLERANCE:
        bar.close()
        raise UserError(
            f"running the model block by block does not reproduce it (relative error {chain_error:.3g}); "
            "the block cut missed a tensor"
        )
    stats = [
        BlockStats(
            k,
            runner.cuts[k].attention,
            runner.cuts[k].width,
            cosine_distance(inputs[k], outputs[k]),
            norm_ratio(deltas[k], inputs[k]),
        )
        for k in range(n)
    ]
    dependency = np.full((n, n), np.nan)
    if runner.streaming:  # column by column, so that each block's weights are loaded once
        streams = {i: inputs[i] for i in rows}  # block i skipped: block i+1 reads block i's input
        for j in range(n):
            for i in (r for r in rows if r < j):
                y = runner.run_block(j, streams[i])
                dependency[i, j] = cosine_distance(deltas[j], y - streams[i])
                streams[i] = y
                bar.update()
    else:
        for i in rows:
            x = inputs[i]  # block i skipped: block i+1 reads block i's input
            for j in range(i + 1, n):
                y = runner.run_block(j, x)
                dependency[i, j] = cosine_distance(deltas[j], y - x)
                x = y
                bar.update()
    bar.close()
    return Analysis(stats, dependency, int(tokens.size), time.perf_counter() - start, total, chain_error)


# ---------------------------------------------------------------------------------------------- figure


def plot_dependency(
    dependency: np.ndarray,
    attention: list[bool],
    groups: Iterable[tuple[int, int]],
    path: str | Path,
    title: str = "Block dependency",
) -> Path:
    """A heatmap of the dependency matrix like the paper's figure: row i = skipped block, column j =
    block whose contribution is measured; attention-free blocks marked along both axes, groups boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Patch, Rectangle

    n = len(attention)
    values = np.asarray(dependency, dtype=np.float64)
    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    low = max(float(positive.min()) if positive.size else 1e-3, 1e-3)
    high = max(float(finite.max()) if finite.size else 1.0, low * 10)
    shown = np.where(np.isfinite(values), np.clip(values, low, None), np.nan)
    size = min(4.0 + 0.28 * n, 16.0)
    fig, ax = plt.subplots(figsize=(size + 1.6, size))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#f2f2f2")
    image = ax.imshow(shown, cmap=cmap, norm=LogNorm(vmin=low, vmax=high), interpolation="nearest")
    free_color, attn_color = "#d62728", "#404040"
    step = 1 if n <= 40 else max(1, n // 40)
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7, rotation=90 if n > 40 else 0)
    ax.set_yticks(ticks, [str(t) for t in ticks], fontsize=7)
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        for label in labels:
            free = not attention[int(label.get_text())]
            label.set_color(free_color if free else attn_color)
            label.set_fontweight("bold" if free else "normal")
    # A strip along the top and the left: one cell per block, red where the block has no attention.
    for k, has_attention in enumerate(attention):
        color = attn_color if has_attention else free_color
        ax.add_patch(Rectangle((k - 0.5, -1.6), 1, 0.8, color=color, clip_on=False))
        ax.add_patch(Rectangle((-1.6, k - 0.5), 0.8, 1, color=color, clip_on=False))
    group_color = "#ff7f0e"
    for first, last in groups:
        ax.add_patch(
            Rectangle(
                (first - 0.5, first - 0.5),
                last - first + 1,
                last - first + 1,
                fill=False,
                edgecolor=group_color,
                linewidth=2.4,
            )
        )
        ax.text(
            last + 0.6,
            first - 0.2,
            f"[{first}, {last}]",
            color=group_color,
            fontsize=8,
            fontweight="bold",
            va="top",
            ha="left",
        )
    ax.set_xlim(-1.7, n - 0.5)
    ax.set_ylim(n - 0.5, -1.7)
    ax.set_xlabel("block j (contribution measured)")
    ax.set_ylabel("block i (skipped)")
    ax.set_title(title, fontsize=11)
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ticks = [m * 10.0**e for e in range(-4, 2) for m in (1, 2, 5) if low <= m * 10.0**e <= high]
    if ticks:
        bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.set_label("dependency: mean 1 - cos(h_j, h~_j)  (log scale)")
    ax.legend(
        handles=[
            Patch(color=free_color, label="attention-free block"),
            Patch(color=attn_color, label="block with attention"),
            Patch(facecolor="none", edgecolor=group_color, linewidth=2, label="proposed group"),
        ],
        loc="lower left",
        fontsize=8,
        framealpha=0.9,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
