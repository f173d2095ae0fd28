"""match_attention and end_projection (passes/patterns/attention.py) on small fragments: decomposed GQA with
an additive or a Where mask (and Optimum's IsNaN guard), the opset-23 Attention op and ONNX Runtime's
GroupQueryAttention with packed QKV give records with the right heads, KV heads, head_dim and form;
near-misses are refused with NoMatch saying why.

passes/model_map.py calls it as `match_attention(residual.branch, start)`: the value the residual Add adds to
the stream (the o_proj output) and what the branch reads (the stream, here `x`). Each fragment has the
branch's norm and the residual Add, as a real block does. 4 query heads, 2 KV heads, head_dim 4.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

from passes.matching import NoMatch
from passes.model_map import build_model_map
from passes.patterns.attention import Attention, branch_nodes, end_projection, match_attention
from tests.passes.patterns.fragments import BOOL, FLOAT, INT32, INT64, Fragment

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4
H, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # 16, 8
SEQ = ["batch", "seq", H]
PACKED_COLUMNS = ((0, H), (H, H + KV), (H + KV, H + 2 * KV))  # q, k, v of one qkv projection


def _norm(f: Fragment) -> tuple[str, str]:
    """(x, the normalized x): the branch reads the stream x through its RMSNorm."""
    x = f.input("x", SEQ)
    return x, f.op("SimplifiedLayerNormalization", x, f.weight(H, offset=1.0), axis=-1, epsilon=1e-6)


def _heads(f: Fragment, t: str, heads: int) -> str:
    """[b, s, heads * hd] -> [b, heads, s, hd]."""
    return f.op("Transpose", f.op("Reshape", t, f.ints(0, 0, heads, HEAD_DIM)), perm=[0, 2, 1, 3])


def _repeat_kv(f: Fragment, t: str) -> str:
    """HF's repeat_kv: [b, kv, s, hd] -> [b, kv, group, s, hd] by Expand -> [b, heads, s, hd]."""
    group = HEADS // KV_HEADS
    expanded = f.op("Expand", f.op("Unsqueeze", t, f.ints(2)), f.ints(1, 1, group, 1, 1))
    return f.op("Reshape", expanded, f.ints(0, HEADS, -1, HEAD_DIM))


def _rotate(f: Fragment, t: str, cos: str, sin: str) -> str:
    """t * cos + rotate_half(t) * sin, rotate_half as Slice/Neg/Concat."""
    half = HEAD_DIM // 2
    first = f.op("Slice", t, f.ints(0), f.ints(half), f.ints(-1))
    second = f.op("Slice", t, f.ints(half), f.ints(HEAD_DIM), f.ints(-1))
    rotated = f.op("Concat", f.op("Neg", second), first, axis=-1)
    return f.op("Add", f.op("Mul", t, cos), f.op("Mul", rotated, sin))


def decomposed(
    f: Fragment,
    *,
    mask: str = "additive",
    guard: bool = False,
    cache: bool = False,
    rotary: bool = False,
    packed: bool = False,
    core: str = "Softmax",
    o_proj_rows: int = H,
    mask_total: str | None = None,
) -> dict[str, str]:
    """A decoder attention sub-block with GQA by Expand/Reshape; returns the names of its parts."""
    x, z = _norm(f)
    names = {"x": x}
    if packed:
        qkv = f.op("MatMul", z, f.weight(H, H + 2 * KV))
        q, k, v = f.ops("Split", qkv, f.ints(H, KV, KV), outputs=3, axis=-1)
        names.update(qkv=qkv)
    else:
        q, k, v = (f.op("MatMul", z, f.weight(H, n)) for n in (H, KV, KV))
    names.update(q=q, k=k, v=v)
    q4, k4, v4 = _heads(f, q, HEADS), _heads(f, k, KV_HEADS), _heads(f, v, KV_HEADS)
    if rotary:
        cos, sin = f.input("cos", ["seq", HEAD_DIM]), f.input("sin", ["seq", HEAD_DIM])
        q4, k4 = _rotate(f, q4, cos, sin), _rotate(f, k4, cos, sin)
    if cache:
        past = ["batch", KV_HEADS, "past", HEAD_DIM]
        k4 = f.op("Concat", f.input("past_key", past), k4, axis=2)
        v4 = f.op("Concat", f.input("past_value", past), v4, axis=2)
        names.update(present_key=k4, present_value=v4)
    scores = f.op("MatMul", q4, f.op("Transpose", _repeat_kv(f, k4), perm=[0, 1, 3, 2]))
    scores = f.op("Mul", scores, f.scalar(HEAD_DIM**-0.5))
    # The keys' length: the sequence, or with a cache one the interpreter cannot name (past + seq).
    mask_dims = ["batch", 1, "seq", mask_total or ("total" if cache else "seq")]
    if mask == "additive":
        scores = f.op("Add", scores, f.input("mask", mask_dims))
    elif mask == "where":  # masked_fill
        scores = f.op("Where", f.input("mask", mask_dims, BOOL), scores, f.scalar(-1e9))
    probs = names["softmax"] = f.op(core, scores, axis=-1) if core == "Softmax" else f.op(core, scores)
    if guard:  # Optimum: rows that are all -inf give NaN; zero them
        probs = f.op("Where", f.op("IsNaN", probs), f.scalar(0.0), probs)
    context = f.op("MatMul", probs, _repeat_kv(f, v4))
    context = f.op("Reshape", f.op("Transpose", context, perm=[0, 2, 1, 3]), f.ints(0, 0, H))
    names["out"] = f.op("MatMul", context, f.weight(o_proj_rows, H))
    names["stream"] = f.op("Add", x, names["out"])
    return names


def _check_heads(record: Attention) -> None:
    assert (record.heads, record.kv_heads, record.head_dim, record.group) == (HEADS, KV_HEADS, HEAD_DIM, 2)
    assert (record.q.out_features, record.k.out_features, record.v.out_features) == (H, KV, KV)


DECOMPOSED = {  # name: (decomposed() keywords, (mask, nan_guard, rotary))
    "additive_mask": ({}, ("additive", False, "none")),
    "where_mask_isnan_guard": ({"mask": "where", "guard": True}, ("where", True, "none")),
    "no_mask": ({"mask": "none"}, ("none", False, "none")),
    "rotary_and_kv_cache": ({"rotary": True, "cache": True}, ("additive", False, "decomposed")),
    "packed_qkv_split": ({"packed": True, "mask": "where"}, ("where", False, "none")),
}


@pytest.mark.parametrize("name", list(DECOMPOSED))
def test_decomposed_attention_gives_its_record(name: str) -> None:
    keywords, (mask, guard, rotary) = DECOMPOSED[name]
    f = Fragment()
    parts = decomposed(f, **keywords)
    extra = [parts["present_key"], parts["present_value"]] if keywords.get("cache") else []
    f.build(parts["stream"], *extra)
    record = match_attention(f[parts["out"]], f[parts["x"]])
    assert record.form == "decomposed" and record.core is f.node(parts["softmax"])
    _check_heads(record)
    assert (record.mask, record.nan_guard, record.rotary) == (mask, guard, rotary)
    assert record.o_proj is f.node(parts["out"])
    if keywords.get("packed"):
        assert record.packed and record.q.node is record.v.node is f.node(parts["qkv"])
        assert (record.q.columns, record.k.columns, record.v.columns) == PACKED_COLUMNS
    else:
        assert not record.packed
        assert (record.q.node, record.k.node, record.v.node) == tuple(f.node(parts[r]) for r in "qkv")
    if keywords.get("cache"):
        caches = {c.kind: (c.past, c.present) for c in record.caches}
        assert caches["key"] == (f["past_key"], f[parts["present_key"]])
        assert caches["value"] == (f["past_value"], f[parts["present_value"]])
    else:
        assert record.caches == ()
    assert record.nodes == frozenset(branch_nodes(f[parts["out"]], f[parts["x"]]))
    assert f.node(parts["stream"]) not in record.nodes and f.node(parts["out"]) in record.nodes


def test_decomposed_fragment_is_a_runnable_attention() -> None:
    """The fragment the tests above read is real: ONNX Runtime runs it (additive mask, rotary, KV cache)."""
    f = Fragment()
    parts = decomposed(f, rotary=True, cache=True)
    f.build(parts["out"])
    rng = np.random.default_rng(3)
    b, s, past = 2, 3, 5
    feeds = {
        "x": rng.standard_normal((b, s, H)),
        "cos": np.cos(rng.standard_normal((s, HEAD_DIM))),
        "sin": np.sin(rng.standard_normal((s, HEAD_DIM))),
        "past_key": rng.standard_normal((b, KV_HEADS, past, HEAD_DIM)),
        "past_value": rng.standard_normal((b, KV_HEADS, past, HEAD_DIM)),
        "mask": np.zeros((b, 1, s, past + s)),
    }
    out = f.run({k: v.astype(np.float32) for k, v in feeds.items()})
    assert out.shape == (b, s, H) and np.isfinite(out).all()


def test_mask_with_another_symbolic_key_length() -> None:
    f = Fragment()
    parts = decomposed(f, mask_total="total")
    f.build(parts["stream"])
    assert match_attention(f[parts["out"]], f[parts["x"]]).mask == "additive"


# ------------------------------------------------------------------------------------------ fused ops


@pytest.mark.parametrize("mask", ["causal", "additive"])
def test_opset23_attention_op(mask: str) -> None:
    f = Fragment(23)
    x, z = _norm(f)
    q, k, v = (f.op("MatMul", z, f.weight(H, n)) for n in (H, KV, KV))
    attn_mask = f.input("mask", ["batch", 1, "seq", "seq"]) if mask == "additive" else None
    causal = {"is_causal": 1} if mask == "causal" else {}
    y = f.op("Attention", q, k, v, attn_mask, q_num_heads=HEADS, kv_num_heads=KV_HEADS, **causal)
    out = f.op("MatMul", y, f.weight(H, H))
    f.build(f.op("Add", x, out))
    record = match_attention(f[out], f[x])
    assert record.form == "Attention" and record.core is f.node(y) and record.mask == mask
    _check_heads(record)
    assert (record.q.node, record.k.node, record.v.node) == (f.node(q), f.node(k), f.node(v))
    assert not record.packed and record.nan_guard is False and record.caches == ()
    if mask == "causal":  # and ONNX Runtime runs it
        got = f.run({"x": np.random.default_rng(4).standard_normal((1, 3, H)).astype(np.float32)})
        assert got.shape == (1, 3, H) and np.isfinite(got).all()


def _group_query_attention(f: Fragment, rotary: bool = False) -> dict[str, str]:
    """GenAI's form: one packed qkv MatMul into com.microsoft GroupQueryAttention with a KV cache."""
    x, z = _norm(f)
    qkv = f.op("MatMul", z, f.weight(H, H + 2 * KV))
    past = ["batch", KV_HEADS, "past", HEAD_DIM]
    inputs = [qkv, None, None, f.input("past_key", past), f.input("past_value", past)]
    inputs += [f.input("seqlens_k", ["batch"], INT32), f.input("total_sequence_length", [], INT32)]
    if rotary:
        inputs += [f.input("cos_cache", ["max", HEAD_DIM // 2]), f.input("sin_cache", ["max", HEAD_DIM // 2])]
    rope = {"do_rotary": 1} if rotary else {}
    y, present_key, present_value = f.ops(
        "GroupQueryAttention",
        *inputs,
        outputs=3,
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        **rope,
    )
    out = f.op("MatMul", y, f.weight(H, H))
    f.build(f.op("Add", x, out), present_key, present_value)
    parts = {"x": x, "qkv": qkv, "gqa": y, "out": out}
    return {**parts, "present_key": present_key, "present_value": present_value}


@pytest.mark.parametrize("rotary", [False, True])
def test_group_query_attention_with_packed_qkv(rotary: bool) -> None:
    f = Fragment()
    parts = _group_query_attention(f, rotary)
    record = match_attention(f[parts["out"]], f[parts["x"]])
    assert record.form == "GroupQueryAttention" and record.core is f.node(parts["gqa"])
    _check_heads(record)
    assert record.packed and record.q.node is record.k.node is record.v.node is f.node(parts["qkv"])
    assert (record.q.columns, record.k.columns, record.v.columns) == PACKED_COLUMNS
    assert record.mask == "op" and record.rotary == ("op" if rotary else "none")
    caches = {c.kind: c for c in record.caches}
    assert caches["key"].past is f["past_key"] and caches["key"].present is f[parts["present_key"]]
    assert caches["value"].past is f["past_value"] and caches["value"].present is f[parts["present_value"]]
    assert all(c.node is record.core for c in record.caches)


# ------------------------------------------------------------------------------------------ near-misses


def _refuse(f: Fragment, out: str, start: str, reason: str) -> None:
    with pytest.raises(NoMatch, match=reason):
        match_attention(f[out], f[start])


def test_no_softmax_is_refused() -> None:
    """Sigmoid attention scores: q, k, v and o_proj, but no Softmax core."""
    f = Fragment()
    parts = decomposed(f, core="Sigmoid")
    f.build(parts["stream"])
    _refuse(f, parts["out"], parts["x"], "expected one Softmax or a fused attention op, found 0 Softmax")


def test_plain_linear_branch_is_refused() -> None:
    """A Nemotron-NAS replace_with_linear attention: norm -> one Linear."""
    f = Fragment()
    x, z = _norm(f)
    out = f.op("MatMul", z, f.weight(H, H))
    f.build(f.op("Add", x, out))
    _refuse(f, out, x, "found 0 Softmax")


def test_branch_not_ending_in_a_projection_is_refused() -> None:
    f = Fragment()
    parts = decomposed(f)
    relu = f.op("Relu", parts["out"])
    f.build(f.op("Add", parts["x"], relu))
    _refuse(f, relu, parts["x"], r"does not end in a linear layer \(o_proj\)")


def test_two_softmax_are_refused() -> None:
    f = Fragment()
    x, z = _norm(f)
    a, b = (f.op("Softmax", f.op("MatMul", z, f.weight(H, H)), axis=-1) for _ in range(2))
    out = f.op("MatMul", f.op("Add", a, b), f.weight(H, H))
    f.build(f.op("Add", x, out))
    _refuse(f, out, x, "found 2 Softmax")


def test_single_head_attention_without_a_head_reshape_is_refused() -> None:
    """exporters/synthetic.py's attention: q @ k^T on [b, s, hidden], no split into heads."""
    f = Fragment()
    x, z = _norm(f)
    q, k, v = (f.op("MatMul", z, f.weight(H, H)) for _ in range(3))
    scores = f.op("MatMul", q, f.op("Transpose", k, perm=[0, 2, 1]))
    out = f.op("MatMul", f.op("MatMul", f.op("Softmax", scores, axis=-1), v), f.weight(H, H))
    f.build(f.op("Add", x, out))
    _refuse(f, out, x, r"no Reshape splitting the q projection into \[.., heads, head_dim\]")


def test_keys_and_values_from_one_projection_are_refused() -> None:
    """k = v: the value projection cannot be told from the key projection."""
    f = Fragment()
    x, z = _norm(f)
    q, kv = f.op("MatMul", z, f.weight(H, H)), f.op("MatMul", z, f.weight(H, KV))
    k4 = _repeat_kv(f, _heads(f, kv, KV_HEADS))
    scores = f.op("MatMul", _heads(f, q, HEADS), f.op("Transpose", k4, perm=[0, 1, 3, 2]))
    context = f.op("MatMul", f.op("Softmax", scores, axis=-1), k4)
    context = f.op("Reshape", f.op("Transpose", context, perm=[0, 2, 1, 3]), f.ints(0, 0, H))
    out = f.op("MatMul", context, f.weight(H, H))
    f.build(f.op("Add", x, out))
    _refuse(f, out, x, "expected one projection feeding .*, found 0")


def test_o_proj_of_another_width_is_refused() -> None:
    """Structure only (it would not run): an o_proj reading 12 features after 4 heads of 4."""
    f = Fragment()
    parts = decomposed(f, o_proj_rows=12)
    f.build(parts["stream"])
    _refuse(f, parts["out"], parts["x"], "o_proj has 12 inputs, q 16 outputs")


def test_query_heads_that_do_not_group_over_the_kv_heads_are_refused() -> None:
    """3 KV heads of 4 for 4 query heads: 4 % 3 != 0."""
    f = Fragment()
    x, z = _norm(f)
    q, k, v = (f.op("MatMul", z, f.weight(H, n)) for n in (H, 12, 12))
    # k and v split into heads by a shape computed at run time: a graph the shape interpreter can read
    k_shape = f.input("kv_shape", [4], INT64)
    k4, v4 = (f.op("Transpose", f.op("Reshape", t, k_shape), perm=[0, 2, 1, 3]) for t in (k, v))
    scores = f.op("MatMul", _heads(f, q, HEADS), f.op("Transpose", k4, perm=[0, 1, 3, 2]))
    context = f.op("MatMul", f.op("Softmax", scores, axis=-1), v4)
    context = f.op("Reshape", f.op("Transpose", context, perm=[0, 2, 1, 3]), f.ints(0, 0, H))
    out = f.op("MatMul", context, f.weight(H, H))
    f.build(f.op("Add", x, out))
    _refuse(f, out, x, "4 query heads cannot be grouped over 3 KV heads")


def test_opset23_attention_with_packed_qkv_is_refused() -> None:
    f = Fragment(23)
    x, z = _norm(f)
    q = f.op("MatMul", z, f.weight(H, H))
    y = f.op("Attention", q, None, None, q_num_heads=HEADS, kv_num_heads=KV_HEADS)
    out = f.op("MatMul", y, f.weight(H, H))
    f.build(f.op("Add", x, out))
    _refuse(f, out, x, "Attention with packed QKV input is not supported")


def test_two_fused_attention_ops_are_refused() -> None:
    f = Fragment(23)
    x, z = _norm(f)
    ys = []
    for _ in range(2):
        q, k, v = (f.op("MatMul", z, f.weight(H, n)) for n in (H, KV, KV))
        ys.append(f.op("Attention", q, k, v, q_num_heads=HEADS, kv_num_heads=KV_HEADS))
    out = f.op("MatMul", f.op("Add", *ys), f.weight(H, H))
    f.build(f.op("Add", x, out))
    _refuse(f, out, x, "2 fused attention ops in one branch")


# ------------------------------------------------------------------------------------------ end_projection


def test_end_projection_looks_through_a_bias_add_and_a_cast() -> None:
    f = Fragment()
    x = f.input("x", SEQ)
    proj = f.op("MatMul", x, f.weight(H, H))
    out = f.op("Cast", f.op("Add", proj, f.weight(H)), to=FLOAT)
    f.build(out)
    assert end_projection(f[out]) is f.node(proj)
    assert end_projection(f[proj]) is f.node(proj)


def test_end_projection_is_none_for_other_ends() -> None:
    f = Fragment()
    x, y = f.input("x", SEQ), f.input("y", SEQ)
    proj = f.op("MatMul", x, f.weight(H, H))
    relu = f.op("Relu", proj)
    total = f.op("Add", proj, y)  # a residual sum of two computed tensors is no bias
    computed = f.op("MatMul", x, f.input("w", [H, H]))  # a MatMul by a computed tensor is no projection
    f.build(relu, total, computed)
    assert end_projection(f[relu]) is None and end_projection(f[total]) is None
    assert end_projection(f[computed]) is None and end_projection(f["x"]) is None
    assert end_projection(None) is None


def test_end_projection_stays_inside_the_given_nodes() -> None:
    f = Fragment()
    x = f.input("x", SEQ)
    proj = f.op("MatMul", x, f.weight(H, H))
    out = f.op("Add", proj, f.weight(H))
    f.build(out)
    assert end_projection(f[out], {f.node(out), f.node(proj)}) is f.node(proj)


def test_end_projection_does_not_return_a_projection_outside_the_given_nodes() -> None:
    f = Fragment()
    x = f.input("x", SEQ)
    proj = f.op("MatMul", x, f.weight(H, H))
    out = f.op("Add", proj, f.weight(H))
    f.build(out)
    assert end_projection(f[out], {f.node(out)}) is None


# ------------------------------------------------------------------------------------------ at the tool level


def test_show_blocks_reads_a_model_whose_mask_names_the_key_length_otherwise(tool, tmp_path) -> None:
    """The fragment of test_mask_with_another_symbolic_key_length in a whole model (embedding, the attention
    block, a SwiGLU block, final norm, lm_head): the model map reads it, the attention's KV heads included,
    and `fuse_onnx.py --show-blocks` prints it (it once exited 3, 'internal error', on the shape conflict)."""
    vocab = 32
    f = Fragment()
    parts = decomposed(f, mask_total="total")
    # the stream starts at a token embedding, not at the graph input x
    f.inputs = [i for i in f.inputs if i.name != "x"]
    ids = f.input("input_ids", ["batch", "seq"], INT64)
    f.nodes.insert(0, helper.make_node("Gather", [f.weight(vocab, H), ids], [parts["x"]]))
    z = f.op("SimplifiedLayerNormalization", parts["stream"], f.weight(H, offset=1.0), epsilon=1e-6)
    gate, up = f.op("MatMul", z, f.weight(H, 2 * H)), f.op("MatMul", z, f.weight(H, 2 * H))
    down = f.op("MatMul", f.op("Mul", f.op("Mul", gate, f.op("Sigmoid", gate)), up), f.weight(2 * H, H))
    stream = f.op("Add", parts["stream"], down)
    final = f.op("SimplifiedLayerNormalization", stream, f.weight(H, offset=1.0), epsilon=1e-6)
    f.build(f.op("MatMul", final, f.weight(H, vocab)))
    blocks = build_model_map(f.model).blocks
    assert [(b.attention, b.kv_heads) for b in blocks] == [(True, KV_HEADS)]
    path = tmp_path / "model.onnx"
    onnx.save(f.proto, str(path))
    rows = json.loads(tool("fuse_onnx", path, "--show-blocks", "--json", check=True).stdout)["blocks"]
    assert [(r["attention"], r["kv_heads"], r["ffn_width"]) for r in rows] == [(True, KV_HEADS, 2 * H)]
