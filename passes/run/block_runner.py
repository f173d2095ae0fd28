"""Running a decoder with ONNX Runtime, whole or block by block on the subgraphs of the graph cut (cut.py).

BlockRunner captures one run of the whole model (every block's streams and the side tensors), then runs
any block on any input stream. Above STREAMING_BYTES of weights it streams (models larger than RAM): a
capture runs the prefix (embedding, rotary tables, masks), each block and the tail (final norm, lm_head)
one after the other, and at most one block's weights are loaded at a time. model_logits gives a model's
logits the same way, so that no model larger than RAM is loaded whole.

A parallel-block graph (passes/parallel.py) has no single member block to run: with `whole_groups` a
parallel group is one cut (cut.py), so captures, run_block and model_logits run it as one unit (one
session: the group's weights at a time); the single-block uses (run_attention, run_branches, a block's FFN
from its rows) refuse its members. Without `whole_groups` such a graph is refused (the analyses' case: they
need single blocks and run on the original model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from passes.blocks import Block
from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.io.model_io import load_model, load_proto, load_typed_proto, weight_bytes
from passes.io.sessions import open_session
from passes.model_map import find_blocks, vocab_size
from passes.patterns import nbits
from passes.reference import ffn_weight_bytes, parallel_sum
from passes.run.cut import NameGraph, cut_blocks, cut_units, fill_stream_types, split_skip_norms, value_types

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



class BlockRunner:
    """Runs a decoder whole (capturing streams and side tensors) or block by block."""

    def __init__(
        self,
        model_path: str | Path,
        threads: int = 0,
        streaming: bool | None = None,
        large_ffn_bytes: int | None = None,
        float_activations: bool = False,
        blocks: list[Block] | None = None,
        view: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
        from_rows: Mapping[int, Callable[[np.ndarray], np.ndarray]] | None = None,
        whole_groups: bool = False,
    ):
        """`float_activations`: int4 MatMulNBits compute on float activations (passes.patterns.nbits), for
        checks of a rewrite's exactness. `blocks`: the block table of the model this graph was made from,
        for a graph the block walk cannot read that keeps that model's stream names (an FP8 graph: the FP8
        pass renames nothing it does not quantize); the blocks are cut between those names in this graph.
        Their weights are the other model's, so no large-FFN reference reads them (large_ffn_bytes None).
        `view`: a rewrite of each subgraph (a copy) before its session, e.g. a half graph's float32 view
        (passes.validate.float32_view): one block's weights converted at a time. `from_rows` (streaming):
        {block position: f}, f(the stream after the block's attention part) its output stream, run instead
        of the block's session (runtime/verify/fp8.py: an FP8 graph's large FFN read from its rows).
        `whole_groups`: cut each parallel group as one unit (module doc): `cuts` (and run_block's k) then
        count units, not blocks; without it a parallel-block graph is refused."""
        if blocks is not None and large_ffn_bytes is not None:
            raise ValueError("large_ffn_bytes reads the blocks' weights: not with another model's blocks")
        self.path = Path(model_path)
        model = load_model(self.path)
        self.blocks = find_blocks(model) if blocks is None else blocks
        grouped = next((b for b in self.blocks if b.parallel is not None), None)
        if grouped is not None and grouped.parallel is not None and not whole_groups:
            # Members of a parallel group share one input and one output: there is no block to cut out.
            raise UserError(
                f"{self.path}: blocks {grouped.parallel[0]}..{grouped.parallel[1]} run in parallel "
                "(a parallel-block graph); run block-by-block analysis on the original model"
            )
        self.proto = load_typed_proto(self.path)
        if float_activations:
            nbits.float_activations(self.proto)
        self.cuts = cut_blocks(self.blocks, self.proto, groups=whole_groups)
        # The block positions of each cut, and the cut of each block position (one-to-one without groups).
        self.units = cut_units(self.blocks) if whole_groups else [[k] for k in range(len(self.blocks))]
        self.unit_of = {k: u for u, unit in enumerate(self.units) for k in unit}
        self.threads = threads
        # A graph that fixes its batch (exporters that trace one example) runs more windows in chunks of that
        # batch (_run). Flat [seq] ids have no batch axis: one window per call, as the caller feeds them.
        signature = Signature.of(self.proto)
        self.fixed_batch = None if signature.flat else signature.batch
        # Streaming (models larger than RAM; default: above STREAMING_BYTES of weights): at most one block's
        # weights are loaded at a time, and captures run block by block instead of as one whole model.
        self.streaming = weight_bytes(model) > STREAMING_BYTES if streaming is None else streaming
        del model
        self._sessions: dict[int, ort.InferenceSession] = {}
        self._attention: dict[int, tuple[list[str], ort.InferenceSession]] = {}
        self.side: dict[str, np.ndarray] = {}
        self.logits: np.ndarray | None = None
        self._tail: tuple[list[str], onnx.ModelProto] | None = None
        self._tail_session: ort.InferenceSession | None = None
        self._branches: dict[int, ort.InferenceSession] = {}
        self.view = view
        self.from_rows = dict(from_rows or {})
        for k in self.from_rows:
            self._single(k, "an FFN from its rows")
        if self.streaming and large_ffn_bytes is not None:
            # A fused group's block can hold a whole group of weights: its FFN is evaluated in float64 from
            # its weights a row block at a time (passes/reference.py) instead of loaded. A parallel group
            # runs whole, whatever its members' sizes: no member has a stream of its own to start from.
            for k, block in enumerate(self.blocks):
                large = block.ffn is not None and ffn_weight_bytes(block) > large_ffn_bytes
                if large and block.parallel is None and k not in self.from_rows:
                    self.from_rows[k] = functools.partial(_ffn_from_rows, block)

    def _single(self, k: int, what: str) -> Block:
        """Block position k's block, for a use that needs it alone: refused for a parallel group's member."""
        block = self.blocks[k]
        if block.parallel is not None:
            first, last = block.parallel
            raise UserError(
                f"{self.path}: block {block.index} runs in parallel with blocks {first}..{last} (a "
                f"parallel-block graph): {what} needs a single block; run it on the original model"
            )
        return block

    def _session(self, proto: onnx.ModelProto, prepack: bool = True) -> ort.InferenceSession:
        if self.view is not None:  # on a copy: the cut keeps its external references, not converted weights
            copy = onnx.ModelProto()
            copy.CopyFrom(proto)
            proto = self.view(copy)
        return session(proto, self.path.parent, self.threads, prepack)

    def _run(
        self, sess: ort.InferenceSession, feed: dict[str, np.ndarray], rows: Iterable[str],
        first: Iterable[str] = (),
    ) -> list[np.ndarray]:
        """sess.run(None, feed). On a graph that fixes its batch, the `rows` feeds (the windows: ids, mask,
        a stream) go in chunks of that batch (the last one padded with its last row) and each output is the
        chunks' concatenated, trimmed; the outputs named in `first` (side tensors: positions, masks, the
        same for every window of equal length) are the first chunk's."""
        rows = set(rows)
        n = next(len(feed[name]) for name in rows)
        size = self.fixed_batch
        if size is None or n == size:
            return sess.run(None, feed)
        names, first = [o.name for o in sess.get_outputs()], set(first)
        parts: list[list[np.ndarray]] = []
        for start in range(0, n, size):
            chunk = {k: _padded(v[start : start + size], size) if k in rows else v for k, v in feed.items()}
            parts.append([np.array(v) for v in sess.run(None, chunk)])
        return [
            parts[0][i] if name in first else np.concatenate([p[i] for p in parts])[:n]
            for i, name in enumerate(names)
        ]

    @property
    def vocab(self) -> int:
        return vocab_size(self.blocks)

    def block_session(self, k: int) -> ort.InferenceSession:
        if k not in self._sessions:
            if self.streaming:
                self._sessions.clear()  # release the previous block's weights before loading these
                self._attention.clear()
                # No prepacked second copy of the weights (measured in docs/scale.md: the peak halves).
                self._sessions[k] = self._session(self.cuts[k].proto, prepack=False)
            else:
                self._sessions[k] = self._session(self.cuts[k].proto)
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
            side = NameGraph(self.proto).block_side_inputs(last, logits)
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
        return self._session(sub)

    def _capture_streaming(
        self, tokens: np.ndarray, extra: Iterable[str], only: bool
    ) -> dict[str, np.ndarray]:
        """capture() block by block: the prefix, then each block's subgraph, one block loaded at a time."""
        extra = set(extra)
        feed = Signature.of(self.proto).feeds(tokens)
        sides = self._side_names(tail=not only)
        prefix = self._prefix(sides)
        values = self._run(prefix, feed, feed, first=sides)
        del prefix
        outputs = dict(zip([self.cuts[0].input_name, *sides], values, strict=True))
        self.side = {n: outputs[n] for n in sides}
        # the stream after a block's attention: only where the block is a cut of its own (not in a group)
        attention_inputs = {
            b.ffn_input.name: self.unit_of[k]
            for k, b in enumerate(self.blocks)
            if b.attention and len(self.units[self.unit_of[k]]) == 1
        }
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
            unit = self.units[k]
            block = self.blocks[unit[0]]
            if len(unit) == 1 and block.attention and block.ffn_input.name in extra:
                outputs[block.ffn_input.name] = self.run_attention(unit[0], x)
            x = outputs[self.cuts[k].output_name] = self.run_block(k, x)
        self._sessions.clear()
        self._attention.clear()
        self.logits = None if only else self.run_tail(x)
        outputs.update(feed)
        return outputs

    def tail_inputs(self) -> list[str]:
        """The side tensors the tail (final norm and lm_head) reads besides the last stream: a whole-model
        capture keeps them when asked (capture(tokens, extra=runner.tail_inputs())) for run_tail."""
        return self._tail_cut()[0]

    def run_tail(self, stream: np.ndarray) -> np.ndarray:
        """The logits for the last block's output `stream` (side tensors from the last capture). A streaming
        runner loads the tail anew each time; a whole-model runner keeps its session."""
        side, proto = self._tail_cut()
        tail = self._tail_session
        if tail is None:
            tail = self._session(proto, prepack=False)
            if not self.streaming:
                self._tail_session = tail
        feed = {self.cuts[-1].output_name: stream, **{n: self.side[n] for n in side}}
        return np.array(self._run(tail, feed, [self.cuts[-1].output_name])[0])

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
        fill_stream_types(proto, [*self._stream_names(), *extra])
        types = value_types(proto)
        feed = Signature.of(proto).feeds(tokens)
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
            sess = self._session(proto)
        finally:
            del proto.graph.output[:]
            proto.graph.output.extend(saved)
        sides = {n for c in self.cuts for n in c.side_inputs}
        values = self._run(sess, feed, feed, first=sides)
        del sess
        outputs = dict(zip(existing + wanted, values, strict=True))
        outputs.update(feed)
        self.side = {n: outputs[n] for c in self.cuts for n in c.side_inputs}
        self.side.update({n: outputs[n] for n in extra if n in outputs})  # e.g. the tail's side tensors
        self.logits = None if only else outputs[existing[0]]
        return outputs

    def close(self) -> None:
        """Drop the sessions and subgraphs (their weights) once the analysis is done."""
        self._sessions.clear()
        self._attention.clear()
        self.cuts = []
        self.proto = onnx.ModelProto()
        self._tail = None
        self._tail_session = None
        self._branches.clear()

    def run_attention(self, k: int, stream: np.ndarray) -> np.ndarray:
        """The stream entering block k's FFN (after its attention sub-block) for block input `stream`
        (k: the block's position in `blocks`)."""
        if k not in self._attention:
            block = self._single(k, "the stream after its attention")
            start, end = block.block_input.name, block.ffn_input.name
            side = NameGraph(self.proto).block_side_inputs(start, end)
            fill_stream_types(self.proto, [*self._stream_names(), end])
            sub = onnx.utils.Extractor(self.proto).extract_model([start, *side], [end])
            if self.streaming:  # release the loaded block first
                self._sessions.clear()
                self._attention.clear()
            self._attention[k] = (side, self._session(sub))
        side, sess = self._attention[k]
        start = self.cuts[self.unit_of[k]].input_name
        feed = {start: stream, **{n: self.side[n] for n in side}}
        return np.array(self._run(sess, feed, [start])[0])  # a copy: see run_block

    def run_branches(self, k: int, stream: np.ndarray) -> list[np.ndarray]:
        """What block k's parts add to the stream for block input `stream`: its attention and FFN residual
        branches (block_k(x) - x, without the float32 cancellation of subtracting two streams)."""
        block, cut = self._single(k, "its residual branches"), self.cuts[self.unit_of[k]]
        sess = self._branches.get(k)
        if sess is None:
            names = [r.branch.name for r in (block.attention_residual, block.residual) if r is not None]
            fill_stream_types(self.proto, [cut.input_name, *names])
            sub = onnx.utils.Extractor(self.proto).extract_model([cut.input_name, *cut.side_inputs], names)
            sess = self._session(sub)
            if not self.streaming:  # a streaming runner holds at most one block's weights
                self._branches[k] = sess
        feed = {cut.input_name: stream, **{n: self.side[n] for n in cut.side_inputs}}
        return [np.array(v) for v in self._run(sess, feed, [cut.input_name])]

    def run_block(self, k: int, stream: np.ndarray) -> np.ndarray:
        """Cut k's output stream for input `stream` (side tensors from the last capture): block k's, or with
        `whole_groups` the k-th unit's (a parallel group runs whole, in one session, whatever its members'
        FFN sizes: no member has a stream of its own to evaluate from rows)."""
        if self.cuts[k].proto is None:  # an identity block
            return np.array(stream)
        position = self.units[k][0]
        block = self.blocks[position]
        if self.streaming and position in self.from_rows:  # a large FFN evaluated from its rows
            x = self.run_attention(position, stream) if block.attention_kind != "none" else stream
            return self.from_rows[position](x).astype(stream.dtype)
        cut = self.cuts[k]
        feed = {cut.input_name: stream, **{n: self.side[n] for n in cut.side_inputs}}
        # A copy: ONNX Runtime's output array keeps the memory of the run it came from (the session's arena)
        # alive after the session is released; the analysis keeps every block's streams.
        return np.array(self._run(self.block_session(k), feed, [cut.input_name])[0])


def _ffn_from_rows(block: Block, x: np.ndarray) -> np.ndarray:
    """Block's output stream from the stream after its attention part: its FFN branch added in float64,
    its weights read a row block at a time (passes/reference.py)."""
    return parallel_sum(x, [block], "last")


def _padded(rows: np.ndarray, size: int) -> np.ndarray:
    """`rows` filled up to `size` rows with copies of its last (a fixed batch's last chunk)."""
    return rows if len(rows) == size else np.concatenate([rows, np.repeat(rows[-1:], size - len(rows), 0)])


def model_logits(
    model_path: str | Path,
    tokens: np.ndarray,
    threads: int = 0,
    view: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
) -> np.ndarray:
    """The model's first output (logits) on `tokens`: one whole-model session, or above STREAMING_BYTES of
    weights block by block (BlockRunner streaming), so that a model larger than RAM is never loaded whole.
    `view`: as BlockRunner's (each subgraph's rewrite before its session; the whole model's too). A
    parallel-block graph streams group by group (a parallel group is one unit: its weights at a time)."""
    path = Path(model_path)
    proto = load_proto(path)
    if weight_bytes(ir.serde.deserialize_model(proto)) <= STREAMING_BYTES:  # sizes only: no data is read
        whole = proto if view is None else view(proto)
        signature, sess = Signature.of(whole), session(whole, path.parent, threads)
        size = signature.batch if tokens.ndim == 2 and not signature.flat else None
        if size is None or len(tokens) == size:
            return sess.run(None, signature.feeds(tokens))[0]
        # a graph that fixes its batch: the windows in chunks of it
        chunks = [tokens[s : s + size] for s in range(0, len(tokens), size)]
        runs = [sess.run(None, signature.feeds(_padded(c, size)))[0][: len(c)] for c in chunks]
        return np.concatenate(runs)

    # A fused model's block may hold a whole group's weights: above LARGE_FFN_BYTES, the row-block reference.
    runner = BlockRunner(
        path, threads, streaming=True, large_ffn_bytes=LARGE_FFN_BYTES, view=view, whole_groups=True
    )
    runner.capture(tokens)
    return runner.logits
