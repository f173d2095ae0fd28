"""A decode graph (KV cache: the interface in exporters/decode.py's module docstring) run block by block, so
that checking one never loads more than one block's weights (as fusion's validation, block_runner.py).

The forward calls of a check (an uncached prefill, then a prefill chunk and one token at a time through the
cache, each with its attention_mask) run LAYER-MAJOR: the prefix (embedding and the side tensors every block
reads: positions from the mask, rotary tables, masks) for every call; then for each block every call in
order, fed that call's stream from the block before and the block's own past caches (the presents of the
call it continues; empty for a call without a cache), the block's session released before the next block
loads; then the tail (final norm, lm_head) for every call. Each block's weights load once; what stays in
memory between blocks is one stream per call, and within a block its caches.

A block's caches are found from the graph: its past inputs are the graph inputs its cut reads, its presents
the graph outputs computed from the stream entering it and not from the stream leaving it (the later
blocks' presents are computed from both). Blocks without attention have no cache. A block whose FFN holds
more than LARGE_FFN_BYTES (a fused group's) runs its attention part (with its presents) in ONNX Runtime and
its FFN from its rows in float64 (passes/reference.py), as block_runner.model_logits does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from passes.errors import UserError
from passes.graph_inputs import Role, Signature
from passes.io.model_io import load_model, load_typed_proto
from passes.model_map import find_blocks
from passes.reference import ffn_weight_bytes, parallel_sum
from passes.run.block_runner import LARGE_FFN_BYTES, session
from passes.run.cut import BlockCut, NameGraph, cut_blocks, cut_units, split_skip_norms


@dataclass(frozen=True)
class DecodeCall:
    """One forward call: token ids [batch, seq], the attention mask [batch, past + seq], and the earlier call
    (its index in the sequence) whose presents are this call's pasts; None: an empty cache."""

    ids: np.ndarray
    mask: np.ndarray
    after: int | None = None


@dataclass
class CacheCut:
    """One cut (a block, or a parallel group as one unit) with its caches: [stream in, *side, *pasts] ->
    [stream out, *presents]; proto None for an identity block. `rows`: the block position whose FFN runs from
    its rows, the ONNX part then ending at the FFN's input (none for an attention-free block)."""

    cut: BlockCut
    side: list[str]
    pasts: list[str]
    presents: list[str]
    proto: onnx.ModelProto | None
    rows: int | None = None


class DecodeStreamer:
    """Runs a decode graph's forward calls block by block (module doc). `view`: a rewrite of each subgraph
    (a copy) before its session, as BlockRunner's; `large_ffn_bytes`: above it a single block's FFN runs from
    its rows (None: never)."""

    def __init__(
        self,
        model_path: str | Path,
        threads: int = 0,
        view: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
        large_ffn_bytes: int | None = LARGE_FFN_BYTES,
    ) -> None:
        self.path = Path(model_path)
        self.threads, self.view = threads, view
        model = load_model(self.path)  # weights stay on disk: only the sizes are read
        self.blocks = find_blocks(model)
        del model
        proto = load_typed_proto(self.path)
        self.signature = Signature.of(proto)
        roles = {i.role for i in self.signature.inputs}
        fed = (Role.IDS, Role.MASK, Role.POSITIONS, Role.PAST)
        unknown = [i.name for i in self.signature.inputs if i.role not in fed]
        if unknown or Role.IDS not in roles:
            what = unknown or "without input_ids"
            raise UserError(f"{self.path}: cannot stream a decode graph with inputs {what}")
        self.past_inputs = {i.name: i for i in self.signature.cache_inputs}
        self.present_of = {name: self.signature.present_for(name) for name in self.past_inputs}
        self.logits_name = self.signature.logits.name
        cuts = cut_blocks(self.blocks, proto, groups=True)  # may split Skip*Normalization nodes in `proto`
        units = cut_units(self.blocks)
        last = cuts[-1].output_name
        split_skip_norms(proto, [last])
        graph = NameGraph(proto)
        extractor = onnx.utils.Extractor(proto)
        outputs = [o.name for o in proto.graph.output if o.name != self.logits_name]
        self.cuts = [
            self._cache_cut(cut, unit, graph, extractor, outputs, large_ffn_bytes)
            for cut, unit in zip(cuts, units, strict=True)
        ]
        self.tail_side = graph.block_side_inputs(last, self.logits_name)
        self.tail = extractor.extract_model([last, *self.tail_side], [self.logits_name])
        self.graph_inputs = [i.name for i in proto.graph.input]
        needed = {n for c in self.cuts for n in c.side} | set(self.tail_side)
        self.prefix_outputs = [cuts[0].input_name, *sorted(needed - set(self.graph_inputs))]
        self.prefix = self._prefix(proto, extractor)

    def _cache_cut(
        self,
        cut: BlockCut,
        unit: list[int],
        graph: NameGraph,
        extractor: onnx.utils.Extractor,
        outputs: list[str],
        large_ffn_bytes: int | None,
    ) -> CacheCut:
        if cut.proto is None:
            return CacheCut(cut, [], [], [], None)
        inside = graph.forward_cone(cut.input_name, values_only=True)
        after = graph.forward_cone(cut.output_name, values_only=True)
        presents = [o for o in outputs if o in inside and o not in after]
        side = set(cut.side_inputs)
        for present in presents:
            side |= set(graph.block_side_inputs(cut.input_name, present))
        pasts = sorted(n for n in side if n in self.past_inputs)
        side = sorted(side - set(pasts))
        block = self.blocks[unit[0]]
        if large_ffn_bytes is not None and len(unit) == 1 and ffn_weight_bytes(block) > large_ffn_bytes:
            # A fused group's FFN: from its rows; the ONNX part is the attention sub-block (with its caches).
            if block.attention_kind == "none":
                return CacheCut(cut, side, pasts, presents, None, rows=unit[0])
            end = block.ffn_input.name
            side = sorted((set(graph.block_side_inputs(cut.input_name, end)) | set(side)) - set(pasts))
            sub = extractor.extract_model([cut.input_name, *side, *pasts], [end, *presents])
            return CacheCut(cut, side, pasts, presents, sub, rows=unit[0])
        sub = extractor.extract_model([cut.input_name, *side, *pasts], [cut.output_name, *presents])
        return CacheCut(cut, side, pasts, presents, sub)

    def _prefix(self, proto: onnx.ModelProto, extractor: onnx.utils.Extractor) -> onnx.ModelProto:
        """graph inputs -> the first stream and every side tensor. Inputs it does not read are dropped; a
        past input it reads must be read for its shape only (a zero cache of the call's past length then)."""
        sub = extractor.extract_model(self.graph_inputs, self.prefix_outputs)
        used = {name for node in sub.graph.node for name in node.input}
        kept = [v for v in sub.graph.input if v.name in used]
        del sub.graph.input[:]
        sub.graph.input.extend(kept)
        prefix_graph = NameGraph(sub)
        wanted = set(self.prefix_outputs)
        for value in kept:
            if value.name in self.past_inputs and prefix_graph.forward_cone(value.name, True) & wanted:
                raise UserError(f"{self.path}: side tensors read the values of cache input {value.name!r}")
        return sub

    def wiring_errors(self) -> list[str]:
        """Caches a block reads that the same block does not write (or writes for another cache): such a graph
        cannot run layer-major, and as one session it feeds one layer's cache to another."""
        writer = {p: c.cut.index for c in self.cuts for p in c.presents}
        errors = []
        for c in self.cuts:
            for past in c.pasts:
                present = self.present_of[past]
                if present is None:
                    errors.append(f"{past!r} (read by block {c.cut.index}) has no present output")
                elif present not in c.presents:
                    where = f"block {writer[present]}" if present in writer else "no block"
                    errors.append(
                        f"{past!r} (read by block {c.cut.index}) continues as {present!r}, which {where} "
                        "writes"
                    )
        read = {self.present_of[p] for c in self.cuts for p in c.pasts}
        for c in self.cuts:
            errors += [
                f"{p!r} (written by block {c.cut.index}) continues no cache it reads"
                for p in c.presents
                if p not in read
            ]
        return errors

    def _session(self, proto: onnx.ModelProto):
        if self.view is not None:  # on a copy: the cut keeps its external references
            copy = onnx.ModelProto()
            copy.CopyFrom(proto)
            proto = self.view(copy)
        return session(proto, self.path.parent, self.threads, prepack=False)  # no prepacked second copy

    def _feeds(self, call: DecodeCall) -> dict[str, np.ndarray]:
        """The call's graph inputs but its caches: ids, mask, and positions counted from the mask (as Hugging
        Face generation and runtime/generate.py's DecodeModel do)."""
        ids, mask = np.asarray(call.ids), np.asarray(call.mask)
        values = {Role.IDS: ids, Role.MASK: mask}
        values[Role.POSITIONS] = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
        return {
            i.name: np.ascontiguousarray(values[i.role], dtype=i.dtype)
            for i in self.signature.inputs
            if i.role in values
        }

    def _empty(self, name: str, batch: int, length: int) -> np.ndarray:
        info = self.past_inputs[name]
        heads, head_dim = info.static(1), info.static(3)
        if heads is None or head_dim is None:
            raise UserError(f"{name} has shape {info.dims}: KV heads and head_dim must be static")
        return np.zeros((batch, heads, length, head_dim), dtype=info.dtype)

    def run(self, calls: Sequence[DecodeCall]) -> list[np.ndarray]:
        """The logits of every call, computed layer-major (module doc)."""
        for k, call in enumerate(calls):
            if call.after is not None and not 0 <= call.after < k:
                raise ValueError(f"call {k} continues call {call.after}, which does not come before it")
        if any(call.after is not None for call in calls) and self.wiring_errors():
            raise UserError(f"{self.path}: cache wiring: {self.wiring_errors()[0]}")
        feeds = [self._feeds(call) for call in calls]
        prefix = self._session(self.prefix)
        streams: list[np.ndarray] = []
        sides: list[dict[str, np.ndarray]] = []
        inputs = [v.name for v in self.prefix.graph.input]
        for call, feed in zip(calls, feeds, strict=True):
            batch, seq = np.shape(call.ids)
            length = np.shape(call.mask)[1] - seq
            prefix_feed = {n: feed[n] if n in feed else self._empty(n, batch, length) for n in inputs}
            outs = [np.array(v) for v in prefix.run(None, prefix_feed)]
            values = dict(zip(self.prefix_outputs, outs, strict=True))
            streams.append(values.pop(self.prefix_outputs[0]))
            sides.append({**values, **feed})
        del prefix
        # How many later calls read each call's presents: a block's caches are kept until their last reader.
        readers = [sum(1 for c in calls if c.after == k) for k in range(len(calls))]
        for cache_cut in self.cuts:
            self._run_cut(cache_cut, calls, streams, sides, readers)
        tail = self._session(self.tail)
        name = self.cuts[-1].cut.output_name
        logits = [
            np.array(tail.run(None, {name: x, **{n: side[n] for n in self.tail_side}})[0])
            for x, side in zip(streams, sides, strict=True)
        ]
        del tail
        return logits

    def _run_cut(
        self,
        cache_cut: CacheCut,
        calls: Sequence[DecodeCall],
        streams: list[np.ndarray],
        sides: list[dict[str, np.ndarray]],
        readers: list[int],
    ) -> None:
        """Every call through one cut, in order: `streams` replaced by the cut's outputs."""
        if cache_cut.proto is None and cache_cut.rows is None:
            return  # an identity block
        sess = self._session(cache_cut.proto) if cache_cut.proto is not None else None
        presents: dict[int, dict[str, np.ndarray]] = {}
        left = list(readers)
        for k, call in enumerate(calls):
            x = streams[k]
            if sess is not None:
                batch, seq = np.shape(call.ids)
                if call.after is None:
                    length = np.shape(call.mask)[1] - seq
                    pasts = {p: self._empty(p, batch, length) for p in cache_cut.pasts}
                else:
                    earlier = presents[call.after]
                    pasts = {p: earlier[self.present_of[p]] for p in cache_cut.pasts}
                    left[call.after] -= 1
                    if not left[call.after]:
                        del presents[call.after]
                feed = {cache_cut.cut.input_name: x, **{n: sides[k][n] for n in cache_cut.side}, **pasts}
                # Copies: ONNX Runtime's outputs keep the run's arena alive after the session is released.
                out = [np.array(v) for v in sess.run(None, feed)]
                x = out[0]
                if left[k]:
                    presents[k] = dict(zip(cache_cut.presents, out[1:], strict=True))
            if cache_cut.rows is not None:  # the block's FFN from its rows, in float64
                x = parallel_sum(x, [self.blocks[cache_cut.rows]], "last").astype(streams[k].dtype)
            streams[k] = x
        del sess
