"""Every linear layer of a graph and its float weight (passes/patterns/linear.py: find_linears)."""

from __future__ import annotations

from passes.io.model_io import load_model
from passes.patterns.linear import find_linears
from tests import fp8_fixtures as fx


def test_find_linears_in_exported_llama(tmp_path_factory):
    model = load_model(fx.model_path("tiny_llama", tmp_path_factory))
    linears = find_linears(model.graph)
    # 2 layers x (q, k, v, o, gate, up, down) + lm_head; attention's Q@K^T and P@V have no constant B.
    assert len(linears) == 2 * 7 + 1
    heads = [lin for lin in linears if lin.is_lm_head]
    assert len(heads) == 1 and heads[0].node.outputs[0].name == "logits"
    # tied embeddings: the lm_head weight is Transpose(embedding), found through the Transpose
    assert heads[0].weight.transpose and heads[0].width == (fx.HIDDEN, fx.VOCAB)
    widths = sorted({lin.width for lin in linears})
    assert (fx.HIDDEN, 128) in widths and (128, fx.HIDDEN) in widths


def test_wide_matmul_is_a_linear(tmp_path_factory):
    model = load_model(fx.model_path("wide_ffn", tmp_path_factory))
    assert max(lin.width[1] for lin in find_linears(model.graph)) == 1024
