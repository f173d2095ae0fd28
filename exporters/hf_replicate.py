"""Build the graph of a many-layer checkpoint by tracing one layer per distinct block kind and copying it.

torch.onnx's dynamo export costs a fixed few seconds per decoder layer, whatever its width, so tracing a
72-layer Nemotron-NAS model takes minutes while copying its weights takes seconds. Layers with the same
LayerConfig (attention kind, KV heads, FFN kind, sliding window) trace to the same subgraph up to their
weight names and SwiGLU width (see layer_key), so exporters.hf_checkpoint traces a reduced model holding
the first layer of each kind, in order, and `replicate_layers` rebuilds the full layer sequence from it:

- Each reduced layer's nodes are found by the exporter's name scopes (`model.layers.J`); those reachable
  from the layer's residual-stream input are its body, the rest (work on cos/sin/masks that the optimizer
  may have shared between layers) stay where they are, once, as in a direct export.
- Full layer I of kind J is a copy of body J with the stream input rewired to the previous layer's output,
  weights renamed model.layers.J.* -> model.layers.I.* (the checkpoint's names), name scopes renamed too,
  and the traced SwiGLU width replaced by layer I's in the shapes of its weights and values.

Any shape of graph this does not expect raises ReplicationError, and the caller traces directly instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import onnx_ir as ir

from exporters.hf_config import HfConfig, LayerConfig

SCOPE_KEY = "pkg.torch.onnx.name_scopes"
EMBEDDING_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")  # a tied embedding may have either name


class ReplicationError(RuntimeError):
    """The traced graph is not a chain of self-contained layers; trace the full model instead."""


def layer_key(layer: LayerConfig, other_dims: set[int] = frozenset()) -> tuple:
    """What decides a layer's subgraph up to its SwiGLU width (the *_field names only feed error messages).

    The width appears in no constant of a layer, only in the shapes of its FFN weights and activations,
    so layers that differ only by width share one traced layer and the copies get their own width in
    those shapes. A width equal to another dimension of the model (`other_dims`) could not be told apart
    in a shape: such a layer is traced with its own width.
    """
    width = layer.ffn_width if layer.ffn == "swiglu" and layer.ffn_width in other_dims else None
    return (layer.attention, layer.kv_heads, layer.ffn, layer.sliding_window, width)


def model_dims(config: HfConfig) -> set[int]:
    """The sizes that may stand in a layer's shapes besides its SwiGLU width."""
    kv = {layer.kv_heads for layer in config.layers}
    head = {config.hidden, config.heads, config.head_dim, config.heads * config.head_dim, config.vocab}
    return head | kv | {k * config.head_dim for k in kv}


def kind_map(config: HfConfig) -> tuple[list[int], list[int]]:
    """(first layer of each distinct kind in order, the reduced layer index of every full layer)."""
    first: dict[tuple, int] = {}
    dims = model_dims(config)
    kinds = [first.setdefault(layer_key(layer, dims), len(first)) for layer in config.layers]
    representatives = [kinds.index(k) for k in range(len(first))]
    return representatives, kinds


def reduced_config(config: HfConfig) -> HfConfig:
    """The config with one layer per distinct kind (the first of each, in order)."""
    representatives, _ = kind_map(config)
    return dataclasses.replace(config, layers=[config.layers[i] for i in representatives])


def representative_name(name: str, representatives: list[int]) -> str:
    """A reduced model's parameter name as the checkpoint names it (reduced layer J is full layer
    representatives[J])."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match is None:
        return name
    return f"model.layers.{representatives[int(match.group(1))]}." + name[match.end() :]


def worth_replicating(config: HfConfig) -> bool:
    representatives, _ = kind_map(config)
    return len(representatives) < len(config.layers)


@dataclasses.dataclass
class _Body:
    """The stream-dependent nodes of one reduced layer, its stream input and output."""

    nodes: list[ir.Node]
    stream_in: ir.Value
    stream_out: ir.Value
    width: int | None = None  # the traced SwiGLU width, replaced in the copies' shapes


def replicate_layers(model: ir.Model, config: HfConfig) -> None:
    """Turn the traced graph of reduced_config(config) into the graph of config, in place."""
    graph = model.graph
    representatives, kinds = kind_map(config)
    bodies = _bodies(graph, max(kinds) + 1)
    for kind, (body, first) in enumerate(zip(bodies, representatives, strict=True)):
        width = config.layers[first].ffn_width
        same = [config.layers[i].ffn_width == width for i, k in enumerate(kinds) if k == kind]
        if config.layers[first].ffn == "swiglu" and not all(same):
            _check_width_only_in_shapes(body, width)
            body.width = width
    last = bodies[-1].stream_out
    in_body = {id(n) for b in bodies for n in b.nodes}
    downstream = [n for n in graph if id(n) not in in_body and any(v is last for v in n.inputs)]
    if not downstream:
        raise ReplicationError("nothing reads the last layer's output")
    anchor = next(n for n in graph if id(n) in {id(d) for d in downstream})
    reduced_weights = {
        v.name: v for b in bodies for n in b.nodes for v in n.inputs if v is not None and _is_weight(graph, v)
    }
    for node in graph:  # work the optimizer shared between layers stays, under its first layer's name
        kind = _layer_of(node)
        if kind is not None and id(node) not in in_body:
            node.metadata_props.update(
                (k, _rename_scope(v, kind, representatives[kind])) for k, v in node.metadata_props.items()
            )
    stream = bodies[0].stream_in
    copies: list[ir.Node] = []
    weights: dict[str, ir.Value] = {}
    for layer, kind in enumerate(kinds):
        body = bodies[kind]
        if body.nodes:
            width = config.layers[layer].ffn_width
            stream = _copy_body(graph, body, kind, layer, width, stream, copies, weights)
    for node in downstream:
        for index, value in enumerate(node.inputs):
            if value is last:
                node.replace_input_with(index, stream)
    graph.remove([n for b in bodies for n in b.nodes], safe=False)
    for name in reduced_weights:
        if graph.initializers.get(name) is reduced_weights[name]:
            graph.initializers.pop(name)
    graph.insert_before(anchor, copies)
    for value in weights.values():
        graph.initializers[value.name] = value


def _is_weight(graph: ir.Graph, value: ir.Value) -> bool:
    return (
        value.producer() is None and value.const_value is None and graph.initializers.get(value.name) is value
    )


def _layer_of(node: ir.Node) -> int | None:
    scopes = node.metadata_props.get(SCOPE_KEY, "")
    match = re.search(r"'model\.layers\.(\d+)'", scopes)
    return int(match.group(1)) if match else None


def _bodies(graph: ir.Graph, count: int) -> list[_Body]:
    """Each reduced layer's stream-dependent nodes, checked to form a chain with one value between links."""
    scoped: list[list[ir.Node]] = [[] for _ in range(count)]
    for node in graph:
        layer = _layer_of(node)
        if layer is not None:
            if layer >= count:
                raise ReplicationError(f"node {node.name} is scoped to layer {layer} of {count}")
            scoped[layer].append(node)
        if any(
            attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for attr in node.attributes.values()
        ):
            raise ReplicationError(f"node {node.name} has a subgraph")
    stream = _embedding_output(graph, scoped)
    bodies = []
    for index, nodes in enumerate(scoped):
        own_weights = [
            v
            for n in nodes
            for v in n.inputs
            if v is not None and _is_weight(graph, v) and v.name.startswith(f"model.layers.{index}.")
        ]
        body = _stream_nodes(nodes, [stream, *own_weights])
        outputs = {id(v): v for n in body for v in n.outputs}
        leaving = {
            id(v): v
            for v in outputs.values()
            if v.is_graph_output() or any(id(user) not in {id(n) for n in body} for user, _ in v.uses())
        }
        if not body:
            bodies.append(_Body([], stream, stream))
            continue
        if len(leaving) != 1:
            raise ReplicationError(f"a layer body has {len(leaving)} outputs read outside it")
        out = next(iter(leaving.values()))
        bodies.append(_Body(body, stream, out))
        stream = out
    _check_chain(graph, bodies)
    return bodies


def _embedding_output(graph: ir.Graph, scoped: list[list[ir.Node]]) -> ir.Value:
    """The residual stream entering the first layer: the one input of the layers the embedding feeds."""
    weights = [graph.initializers[n] for n in EMBEDDING_WEIGHTS if n in graph.initializers]
    reached = _reachable(weights)
    first = next((nodes for nodes in scoped if nodes), [])
    own = {id(v) for n in first for v in n.outputs}
    found = {
        id(v): v for n in first for v in n.inputs if v is not None and id(v) in reached and id(v) not in own
    }
    if len(found) != 1:
        raise ReplicationError(f"the first layer reads {len(found)} values computed from the embedding")
    return next(iter(found.values()))


def _reachable(values: Iterable[ir.Value]) -> set[int]:
    """ids of every value computed (transitively) from `values`, and of the values themselves."""
    seen = {id(v) for v in values}
    todo = list(values)
    while todo:
        for user, _ in todo.pop().uses():
            for out in user.outputs:
                if id(out) not in seen:
                    seen.add(id(out))
                    todo.append(out)
    return seen


def _stream_nodes(nodes: list[ir.Node], sources: list[ir.Value]) -> list[ir.Node]:
    """The nodes of `nodes` (in graph order) that depend on `sources` (the stream, the layer's weights)."""
    live = {id(v) for v in sources}
    body = []
    for node in nodes:
        if any(v is not None and id(v) in live for v in node.inputs):
            body.append(node)
            live.update(id(v) for v in node.outputs)
    return body


def _check_chain(graph: ir.Graph, bodies: list[_Body]) -> None:
    """Every body reads only its stream input, its own values, weights and values computed before any body."""
    body_values = {id(v) for b in bodies for n in b.nodes for v in n.outputs}
    links = [b for b in bodies if b.nodes]
    for body, after in zip(links, links[1:], strict=False):
        readers = {id(n) for n in after.nodes}
        if body.stream_out.is_graph_output() or any(id(u) not in readers for u, _ in body.stream_out.uses()):
            raise ReplicationError(f"{body.stream_out.name} is read beyond the next layer")
    for index, body in enumerate(bodies):
        own = {id(v) for n in body.nodes for v in n.outputs} | {id(body.stream_in)}
        for node in body.nodes:
            for value in node.inputs:
                if value is None or id(value) in own:
                    continue
                if id(value) in body_values:
                    raise ReplicationError(f"layer {index} reads {value.name} from another layer")
                foreign = not (_is_weight(graph, value) and value.name.startswith(f"model.layers.{index}."))
                unset = value.producer() is None and value.const_value is None and not value.is_graph_input()
                if unset and foreign:
                    raise ReplicationError(f"layer {index} reads a foreign weight {value.name}")


def _copy_body(
    graph: ir.Graph,
    body: _Body,
    kind: int,
    layer: int,
    width: int,
    stream: ir.Value,
    copies: list[ir.Node],
    weights: dict[str, ir.Value],
) -> ir.Value:
    """Append to `copies` body `kind` as layer `layer` (SwiGLU width `width`), reading `stream`; returns
    its output."""
    sizes = {body.width: width} if body.width is not None else {}
    mapping: dict[int, ir.Value] = {id(body.stream_in): stream}
    prefix = f"model.layers.{kind}."
    for node in body.nodes:
        inputs = []
        for value in node.inputs:
            if value is not None and id(value) not in mapping and _is_weight(graph, value):
                name = f"model.layers.{layer}." + value.name.removeprefix(prefix)
                if name not in weights:
                    weights[name] = ir.Value(
                        name=name, shape=_copy_shape(value.shape, sizes), type=value.type
                    )
                mapping[id(value)] = weights[name]
            inputs.append(mapping.get(id(value), value) if value is not None else None)
        outputs = [
            ir.Value(name=f"layers.{layer}/{v.name}", shape=_copy_shape(v.shape, sizes), type=v.type)
            for v in node.outputs
        ]
        mapping.update((id(old), new) for old, new in zip(node.outputs, outputs, strict=True))
        copies.append(
            ir.Node(
                node.domain,
                node.op_type,
                inputs,
                [ir.Attr(a.name, a.type, a.value, doc_string=a.doc_string) for a in node.attributes.values()],
                overload=node.overload,
                outputs=outputs,
                version=node.version,
                name=f"layers.{layer}/{node.name}",
                doc_string=node.doc_string,
                metadata_props={k: _rename_scope(v, kind, layer) for k, v in node.metadata_props.items()},
            )
        )
    return mapping[id(body.stream_out)]


def _copy_shape(shape: ir.Shape | None, sizes: dict[int, int]) -> ir.Shape | None:
    """A copy of `shape` with static dims replaced as `sizes` says (the traced width by the layer's)."""
    if shape is None:
        return None
    return ir.Shape([sizes.get(d, d) if isinstance(d, int) else d for d in shape])


def _check_width_only_in_shapes(body: _Body, width: int) -> None:
    """The traced width must stand in no attribute or constant of the body, or the copies would keep it."""
    for node in body.nodes:
        for attr in node.attributes.values():
            values = attr.value if isinstance(attr.value, (list, tuple)) else [attr.value]
            if any(isinstance(v, int) and v == width for v in values):
                raise ReplicationError(f"node {node.name} has the FFN width {width} in attribute {attr.name}")
        for value in node.inputs:
            const = None if value is None or value.producer() is not None else value.const_value
            if const is not None and const.size <= 64 and width in const.numpy().ravel().tolist():
                raise ReplicationError(f"node {node.name} reads the FFN width {width} from {value.name}")


def _rename_scope(text: str, kind: int, layer: int) -> str:
    return re.sub(rf"(model[._]layers[._]){kind}(?!\d)", rf"\g<1>{layer}", text)
