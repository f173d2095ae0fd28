"""The prefill graph of a Hugging Face Llama-family or Nemotron-NAS (DeciLM) checkpoint, built with onnx-ir.

    model = build_prefill(config, "bfloat16")    # forward(input_ids) -> logits; weights without values

Built straight from `exporters.hf.config.HfConfig` (no torch, well under a second at any depth): one
input `input_ids` int64 [batch, seq], one output `logits` float32 [batch, seq, vocab]. Every weight is
an initializer named as its safetensors tensor, with a shape and no value (exporters.hf.data_file points
it at the data file); a tied lm_head reads the embedding's one initializer.

`ModelGraph` is the forward pass itself (norms, linear layers, SwiGLU, rotary, GQA); `_Prefill` gives it
the prefill graph's positions (0..seq-1) and causal masks. exporters.hf.decode_graph builds the KV-cache
decode graph on the same class: positions and masks from an attention_mask, keys and values appended to
a cache.

The graph computes what transformers' LlamaForCausalLM / DeciLM forward computes, in the op forms the
torch dynamo exporter writes for it, so the passes read it as before (docs/export.md, "Hugging Face
checkpoints"):

- RMSNorm in the HF form: [Cast to float32] -> Pow 2 -> ReduceMean(-1) -> Add eps -> Sqrt -> Reciprocal
  -> Mul(x, .) [-> Cast back] -> Mul(weight, .);
- linear layers read their [out, in] weight through Transpose -> MatMul, a bias by a following Add;
- SwiGLU: MatMul(gate) -> Sigmoid -> Mul(gate, .) -> Mul(., MatMul(up)) -> MatMul(down);
- GQA attention: q/k/v Reshape to heads (shapes from Shape(input_ids)), rotary as Mul/Slice/Neg/Concat
  (rotate_half), grouped q view [b, kv, group, s, d] against k/v unsqueezed to one group, scale, additive
  causal (and sliding-window) mask, Softmax, o_proj; layers whose attention or FFN is replaced by one
  Linear (DeciLM replace_with_linear) read `self_attn.linear_attn` / `mlp.linear_mlp`;
- rotary cos/sin in float32 from fixed inverse frequencies (exporters.hf.rope; default, linear, llama3,
  yarn, times the attention factor) or, for dynamic NTK, a base computed from the sequence length.

In float16/bfloat16 graphs activations are in that dtype and norms compute in float32 between casts,
exactly where the torch model casts; logits are cast to float32. Node names carry their module path
(`model.layers.3.self_attn.q_proj/MatMul`), which passes.model_map.layer_name reads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import onnx_ir as ir

from exporters.hf.config import HfConfig, LayerConfig
from exporters.hf.rope import exponents, rope_parameters

OPSET = 20  # the dynamo exporter's default, which the passes and runtimes are tested with
IR_DTYPES = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}
FLOAT = ir.DataType.FLOAT
INT64 = ir.DataType.INT64
INT64_MAX = np.iinfo(np.int64).max
BATCH, SEQ = "batch", "seq"  # dim names; a decode graph's keys also span TOTAL (past + new)


class _Builder:
    """Nodes in creation (topological) order, named by module scope; constants and weights as initializers."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []
        self.initializers: dict[str, ir.Value] = {}
        self._scope = ""
        self._names: dict[str, int] = {}

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        outer, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = outer

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value],
        dtype: ir.DataType,
        shape: Sequence[int | str],
        **attributes,
    ) -> ir.Value:
        name = self._unique(f"{self._scope}/{op_type}" if self._scope else op_type)
        output = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        node = ir.Node(
            "",
            op_type,
            inputs,
            attributes=ir.convenience.convert_attributes(attributes),
            outputs=[output],
            name=name,
        )
        self.nodes.append(node)
        return output

    def const(self, name: str, value: np.ndarray | float | int | Sequence, dtype: ir.DataType) -> ir.Value:
        """A constant initializer, made once per name (the caller names it by what it holds)."""
        if name not in self.initializers:
            array = np.asarray(value, dtype=np.float32 if dtype.is_floating_point() else np.int64)
            tensor = ir.tensor(array.astype(dtype.numpy()), dtype=dtype, name=name)
            self.initializers[name] = ir.Value(
                name=name, type=ir.TensorType(dtype), shape=ir.Shape(array.shape), const_value=tensor
            )
        return self.initializers[name]

    def ints(self, *values: int) -> ir.Value:
        """An int64 [n] constant (axes, shape pieces, slice bounds)."""
        return self.const("ints_" + "_".join(str(v).replace("-", "m") for v in values), list(values), INT64)

    def weight(self, name: str, shape: Sequence[int], dtype: ir.DataType) -> ir.Value:
        """A checkpoint tensor: a named initializer with no value (attached to the data file later)."""
        if name not in self.initializers:
            self.initializers[name] = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        return self.initializers[name]

    def _unique(self, name: str) -> str:
        count = self._names.get(name, 0)
        self._names[name] = count + 1
        return name if count == 0 else f"{name}_{count}"


class ModelGraph:
    """The forward pass of one config, built in forward order. A subclass says what differs between graphs:
    the extra inputs (`_inputs`), the rotary positions (`_positions`, `_position_count`), the additive
    attention mask (`_mask`) and what attention does with a layer's new keys and values (`_keys`)."""

    KEYS = SEQ  # the dim name of the keys attention reads (a decode graph's: past + new)

    def __init__(self, config: HfConfig, dtype: ir.DataType) -> None:
        self.config, self.dtype, self.b = config, dtype, _Builder()
        self.hidden, self.head_dim = config.hidden, config.head_dim
        self.input_ids = ir.Value(name="input_ids", type=ir.TensorType(INT64), shape=ir.Shape([BATCH, SEQ]))
        self.outputs: list[ir.Value] = []  # after logits (a decode graph's present keys and values)
        self._shapes: dict[tuple, ir.Value] = {}
        self._masks: dict[int | None, ir.Value] = {}  # by sliding window (None: causal only)

    # ------------------------------------------------------------------------------ what subclasses give

    def _inputs(self) -> list[ir.Value]:
        """The graph inputs besides input_ids."""
        return []

    def _positions(self) -> tuple[ir.Value, list[int | str]]:
        """Rotary positions in float32 and their shape ([seq] or [batch, seq])."""
        raise NotImplementedError

    def _position_count(self, positions: ir.Value) -> ir.Value:
        """float32 [1]: the largest position + 1 (dynamic NTK's sequence length)."""
        raise NotImplementedError

    def _mask(self, window: int | None) -> ir.Value:
        """The additive mask a layer's scores [batch, kv, group, seq, KEYS] add (None: no sliding window)."""
        raise NotImplementedError

    def _keys(self, index: int, k: ir.Value, v: ir.Value, kv: int) -> tuple[ir.Value, ir.Value]:
        """The keys and values layer `index` attends to, given its new ones [batch, kv, seq, head_dim]."""
        return k, v

    # ------------------------------------------------------------------------------------------ the graph

    def build(self) -> ir.Graph:
        b, config = self.b, self.config
        with b.scope("model"):
            self.batch = b.op("Shape", [self.input_ids], INT64, [1], start=0, end=1)
            self.seq = b.op("Shape", [self.input_ids], INT64, [1], start=1, end=2)
        inputs = self._inputs()
        embedding = b.weight("model.embed_tokens.weight", [config.vocab, self.hidden], self.dtype)
        with b.scope("model.embed_tokens"):
            x = b.op("Gather", [embedding, self.input_ids], self.dtype, [BATCH, SEQ, self.hidden], axis=0)
        self.cos, self.sin = self._rotary()
        for index, layer in enumerate(config.layers):
            x = self._layer(x, index, layer)
        x = self._rmsnorm(x, "model.norm")
        head = embedding if config.tie_embeddings else None
        with b.scope("lm_head"):
            logits = self._linear(x, "lm_head", config.vocab, self.hidden, weight=head)
            if self.dtype != FLOAT:
                logits = b.op("Cast", [logits], FLOAT, [BATCH, SEQ, config.vocab], to=FLOAT)
        logits.name = "logits"
        return ir.Graph(
            [self.input_ids, *inputs],
            [logits, *self.outputs],
            nodes=b.nodes,
            initializers=list(b.initializers.values()),
            opset_imports={"": OPSET},
            name="main_graph",
        )

    # ------------------------------------------------------------------------------------ shared inputs

    def _rotary(self) -> tuple[ir.Value, ir.Value]:
        """cos, sin [1, 1, seq, head_dim] (positions [seq]) or [batch, 1, seq, head_dim] (positions
        [batch, seq]), in the graph's dtype."""
        b, rope, half, dim = self.b, self.config.rope, self.head_dim // 2, self.head_dim
        inv_freq, attention_factor = rope_parameters(rope, dim)
        positions, lead = self._positions()
        # [seq] -> [1, 1, seq, d]; [batch, seq] -> [batch, 1, seq, d]
        axes, table_shape = ((0, 1), [1, 1, SEQ, dim]) if len(lead) == 1 else ((1,), [BATCH, 1, SEQ, dim])
        with b.scope("model.rotary_emb"):
            if rope.rope_type == "dynamic":
                frequencies = self._dynamic_frequencies(positions)
            else:
                frequencies = b.const("model.rotary_emb.inv_freq", inv_freq[None, :], FLOAT)
            column = b.op("Unsqueeze", [positions, b.ints(len(lead))], FLOAT, [*lead, 1])
            angles = b.op("Mul", [column, frequencies], FLOAT, [*lead, half])
            angles = b.op("Concat", [angles, angles], FLOAT, [*lead, dim], axis=-1)
            tables = []
            for op in ("Cos", "Sin"):
                table = b.op(op, [angles], FLOAT, [*lead, dim])
                if attention_factor != 1.0:
                    factor = b.const("model.rotary_emb.attention_factor", attention_factor, FLOAT)
                    table = b.op("Mul", [table, factor], FLOAT, [*lead, dim])
                tables.append(b.op("Unsqueeze", [table, b.ints(*axes)], FLOAT, table_shape))
        if self.dtype != FLOAT:
            with b.scope("model"):
                tables = [b.op("Cast", [t], self.dtype, table_shape, to=self.dtype) for t in tables]
        return tables[0], tables[1]

    def _dynamic_frequencies(self, positions: ir.Value) -> ir.Value:
        """transformers' dynamic NTK: the base grows once the largest position + 1 passes max_positions
        (for a cache filled in order, what its stateful rotary module holds at each call)."""
        b, rope, dim = self.b, self.config.rope, self.head_dim
        length = self._position_count(positions)
        max_positions = b.const("rope.max_positions", float(rope.max_positions), FLOAT)
        length = b.op("Clip", [length, max_positions], FLOAT, [1])
        scaled = b.op("Mul", [length, b.const("rope.factor", rope.factor, FLOAT)], FLOAT, [1])
        scaled = b.op("Div", [scaled, max_positions], FLOAT, [1])
        scaled = b.op("Sub", [scaled, b.const("rope.factor_minus_one", rope.factor - 1, FLOAT)], FLOAT, [1])
        base = b.op("Pow", [scaled, b.const("rope.base_exponent", dim / (dim - 2), FLOAT)], FLOAT, [1])
        base = b.op("Mul", [base, b.const("rope.theta", rope.theta, FLOAT)], FLOAT, [1])
        table = b.const("model.rotary_emb.exponents", exponents(dim), FLOAT)
        powers = b.op("Pow", [base, table], FLOAT, [dim // 2])
        inv_freq = b.op("Reciprocal", [powers], FLOAT, [dim // 2])
        return b.op("Unsqueeze", [inv_freq, b.ints(0)], FLOAT, [1, dim // 2])

    def _shape(self, *pieces: int | str) -> ir.Value:
        """An int64 shape from the input's batch and seq and fixed sizes (one node per distinct shape)."""
        if pieces not in self._shapes:
            values = [self.batch if p == BATCH else self.seq if p == SEQ else self.b.ints(p) for p in pieces]
            with self.b.scope("model"):
                self._shapes[pieces] = self.b.op("Concat", values, INT64, [len(pieces)], axis=0)
        return self._shapes[pieces]

    # ------------------------------------------------------------------------------------------ layers

    def _layer(self, x: ir.Value, index: int, layer: LayerConfig) -> ir.Value:
        b, prefix = self.b, f"model.layers.{index}"
        if layer.attention != "none":
            normed = self._rmsnorm(x, f"{prefix}.input_layernorm")
            with b.scope(f"{prefix}.self_attn"):
                if layer.attention == "gqa":
                    branch = self._attention(normed, f"{prefix}.self_attn", layer, index)
                else:
                    branch = self._linear(normed, f"{prefix}.self_attn.linear_attn", self.hidden, self.hidden)
            with b.scope(prefix):
                x = b.op("Add", [x, branch], self.dtype, [BATCH, SEQ, self.hidden])
        if layer.ffn != "none":
            normed = self._rmsnorm(x, f"{prefix}.post_attention_layernorm")
            with b.scope(f"{prefix}.mlp"):
                if layer.ffn == "swiglu":
                    branch = self._swiglu(normed, f"{prefix}.mlp", layer.ffn_width)
                else:
                    branch = self._linear(normed, f"{prefix}.mlp.linear_mlp", self.hidden, self.hidden)
            with b.scope(prefix):
                x = b.op("Add", [x, branch], self.dtype, [BATCH, SEQ, self.hidden])
        return x

    def _rmsnorm(self, x: ir.Value, module: str) -> ir.Value:
        """weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(dtype): transformers' RMSNorm."""
        b, shape, half = self.b, [BATCH, SEQ, self.hidden], self.dtype != FLOAT
        weight = b.weight(f"{module}.weight", [self.hidden], self.dtype)
        with b.scope(module):
            x32 = b.op("Cast", [x], FLOAT, shape, to=FLOAT) if half else x
            square = b.op("Pow", [x32, b.const("two", 2.0, FLOAT)], FLOAT, shape)
            mean = b.op(
                "ReduceMean", [square, b.ints(-1)], FLOAT, [BATCH, SEQ, 1], keepdims=1, noop_with_empty_axes=0
            )
            mean = b.op(
                "Add", [mean, b.const("rms_norm_eps", self.config.eps, FLOAT)], FLOAT, [BATCH, SEQ, 1]
            )
            root = b.op("Sqrt", [mean], FLOAT, [BATCH, SEQ, 1])
            inverse = b.op("Reciprocal", [root], FLOAT, [BATCH, SEQ, 1])
            normed = b.op("Mul", [x32, inverse], FLOAT, shape)
            if half:
                normed = b.op("Cast", [normed], self.dtype, shape, to=self.dtype)
            return b.op("Mul", [weight, normed], self.dtype, shape)

    def _linear(
        self, x: ir.Value, module: str, out: int, inp: int, bias: bool = False, weight: ir.Value | None = None
    ) -> ir.Value:
        """x @ W.T (+ b) with W [out, in] as the checkpoint stores it, read through Transpose."""
        b = self.b
        weight = weight if weight is not None else b.weight(f"{module}.weight", [out, inp], self.dtype)
        shape = [*x.shape[:-1], out]
        with b.scope(module):
            transposed = b.op("Transpose", [weight], self.dtype, [inp, out], perm=[1, 0])
            y = b.op("MatMul", [x, transposed], self.dtype, shape)
            if bias:
                y = b.op("Add", [y, b.weight(f"{module}.bias", [out], self.dtype)], self.dtype, shape)
        return y

    def _swiglu(self, x: ir.Value, module: str, width: int) -> ir.Value:
        b, shape = self.b, [BATCH, SEQ, width]
        gate = self._linear(x, f"{module}.gate_proj", width, self.hidden)
        with b.scope(f"{module}.act_fn"):
            gate = b.op("Mul", [gate, b.op("Sigmoid", [gate], self.dtype, shape)], self.dtype, shape)
        up = self._linear(x, f"{module}.up_proj", width, self.hidden)
        hidden = b.op("Mul", [gate, up], self.dtype, shape)
        return self._linear(hidden, f"{module}.down_proj", self.hidden, width)

    def _attention(self, x: ir.Value, module: str, layer: LayerConfig, index: int) -> ir.Value:
        """Causal GQA with rotary embeddings; query heads grouped per KV head, K/V broadcast over a group.
        The keys and values are the new ones (prefill) or the cache's with the new ones appended (decode)."""
        b, config, dim, dtype = self.b, self.config, self.head_dim, self.dtype
        heads, kv = config.heads, layer.kv_heads
        group = heads // kv
        q = self._heads(x, f"{module}.q_proj", heads, config.qkv_bias)
        k = self._heads(x, f"{module}.k_proj", kv, config.qkv_bias)
        v = self._heads(x, f"{module}.v_proj", kv, config.qkv_bias)
        q, k = self._rotate(q, heads), self._rotate(k, kv)
        k, v = self._keys(index, k, v, kv)
        keys = self.KEYS
        q = b.op(
            "Reshape",
            [q, self._shape(BATCH, kv, group, SEQ, dim)],
            dtype,
            [BATCH, kv, group, SEQ, dim],
            allowzero=1,
        )
        k = b.op("Unsqueeze", [k, b.ints(2)], dtype, [BATCH, kv, 1, keys, dim])
        k = b.op("Transpose", [k], dtype, [BATCH, kv, 1, dim, keys], perm=[0, 1, 2, 4, 3])
        scores_shape = [BATCH, kv, group, SEQ, keys]
        scores = b.op("MatMul", [q, k], dtype, scores_shape)
        scores = b.op(
            "Mul", [scores, b.const(f"attention_scale_{dim}", dim**-0.5, dtype)], dtype, scores_shape
        )
        scores = b.op("Add", [scores, self._mask(layer.sliding_window)], dtype, scores_shape)
        probs = b.op("Softmax", [scores], dtype, scores_shape, axis=-1)
        v = b.op("Unsqueeze", [v, b.ints(2)], dtype, [BATCH, kv, 1, keys, dim])
        out = b.op("MatMul", [probs, v], dtype, [BATCH, kv, group, SEQ, dim])
        out = b.op(
            "Reshape",
            [out, self._shape(BATCH, heads, SEQ, dim)],
            dtype,
            [BATCH, heads, SEQ, dim],
            allowzero=1,
        )
        out = b.op("Transpose", [out], dtype, [BATCH, SEQ, heads, dim], perm=[0, 2, 1, 3])
        width = heads * dim
        out = b.op("Reshape", [out, self._shape(BATCH, SEQ, width)], dtype, [BATCH, SEQ, width], allowzero=1)
        return self._linear(out, f"{module}.o_proj", self.hidden, width, config.o_bias)

    def _heads(self, x: ir.Value, module: str, heads: int, bias: bool) -> ir.Value:
        """A projection split into heads: [batch, heads, seq, head_dim]."""
        b, dim = self.b, self.head_dim
        y = self._linear(x, module, heads * dim, self.hidden, bias)
        y = b.op(
            "Reshape",
            [y, self._shape(BATCH, SEQ, heads, dim)],
            self.dtype,
            [BATCH, SEQ, heads, dim],
            allowzero=1,
        )
        return b.op("Transpose", [y], self.dtype, [BATCH, heads, SEQ, dim], perm=[0, 2, 1, 3])

    def _rotate(self, x: ir.Value, heads: int) -> ir.Value:
        """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])."""
        b, dim, dtype = self.b, self.head_dim, self.dtype
        half, full = [BATCH, heads, SEQ, dim // 2], [BATCH, heads, SEQ, dim]
        axis, step = b.ints(3), b.ints(1)
        second = b.op("Slice", [x, b.ints(dim // 2), b.ints(INT64_MAX), axis, step], dtype, half)
        first = b.op("Slice", [x, b.ints(0), b.ints(dim // 2), axis, step], dtype, half)
        rotated = b.op("Concat", [b.op("Neg", [second], dtype, half), first], dtype, full, axis=-1)
        return b.op(
            "Add",
            [b.op("Mul", [x, self.cos], dtype, full), b.op("Mul", [rotated, self.sin], dtype, full)],
            dtype,
            full,
        )


class _Prefill(ModelGraph):
    """The prefill graph: positions 0..seq-1, a causal mask over the new tokens alone."""

    def __init__(self, config: HfConfig, dtype: ir.DataType) -> None:
        super().__init__(config, dtype)
        self._full: ir.Value | None = None  # -inf [seq, seq]
        self._causal: ir.Value | None = None

    def _positions(self) -> tuple[ir.Value, list[int | str]]:
        b = self.b
        with b.scope("model"):
            length = b.op("Squeeze", [self.seq], INT64, [])
            length = b.op("Cast", [length], FLOAT, [], to=FLOAT)
            positions = b.op(
                "Range", [b.const("zero", 0.0, FLOAT), length, b.const("one", 1.0, FLOAT)], FLOAT, [SEQ]
            )
        return positions, [SEQ]

    def _position_count(self, positions: ir.Value) -> ir.Value:
        b = self.b
        last = b.op("Slice", [positions, b.ints(-1), b.ints(INT64_MAX), b.ints(0), b.ints(1)], FLOAT, [1])
        return b.op("Add", [last, b.const("one", 1.0, FLOAT)], FLOAT, [1])

    def _mask(self, window: int | None) -> ir.Value:
        """Additive [1, 1, seq, seq]: -inf above the diagonal and, with a window, at key <= query - window."""
        if window not in self._masks:
            b, dtype, square = self.b, self.dtype, [SEQ, SEQ]
            with b.scope("model"):
                if self._causal is None:
                    size = b.op("Concat", [self.seq, self.seq], INT64, [2], axis=0)
                    self._full = b.op("Expand", [b.const("minus_inf", -np.inf, dtype), size], dtype, square)
                    one = b.const("diagonal_1", 1, INT64)
                    self._causal = b.op("Trilu", [self._full, one], dtype, square, upper=1)
                mask = self._causal
                if window is not None:
                    below = b.const(f"diagonal_minus_{window}", -window, INT64)
                    too_old = b.op("Trilu", [self._full, below], dtype, square, upper=0)
                    mask = b.op("Add", [mask, too_old], dtype, square)
                self._masks[window] = b.op("Unsqueeze", [mask, b.ints(0, 1)], dtype, [1, 1, SEQ, SEQ])
        return self._masks[window]


def build_prefill(config: HfConfig, dtype: str, opset: int | None = None) -> ir.Model:
    """The prefill graph of `config` in `dtype` (float32 | float16 | bfloat16), weights without values."""
    graph = _Prefill(config, IR_DTYPES[dtype]).build()
    graph.opset_imports[""] = opset or OPSET
    return ir.Model(graph, ir_version=10, producer_name="ffn-fusion exporters.hf.prefill_graph")
