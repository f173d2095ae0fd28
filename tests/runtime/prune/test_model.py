"""runtime/prune/model.py: the checkpoint as a torch model equals transformers' Llama; attention removal."""

from __future__ import annotations

import pytest
import torch

from passes.errors import UserError
from runtime.prune.model import load_checkpoint
from tests.runtime.prune.fixtures import VOCAB, write_tiny_llama, write_tiny_nemotron


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "ckpt")


def test_logits_equal_transformers(llama) -> None:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only this reference needs it)

    reference = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    model = load_checkpoint(llama)
    ids = torch.randint(4, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        got = model.forward(ids)
        x = model.embed(ids)
        for i in range(model.n_layers):
            x = model.run_layer(i, x)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    assert torch.equal(model.logits(x), got)


def test_remove_attention_is_skipping_it(llama) -> None:
    model = load_checkpoint(llama)
    ids = torch.randint(4, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        skipped = model.forward(ids, skip_attention=3)
        full = model.forward(ids)
        copy = model.copy()
        copy.remove_attention(3)
        assert torch.equal(copy.forward(ids), skipped)
        assert torch.equal(model.forward(ids), full)  # the copy's change did not touch the original
    assert not torch.allclose(skipped, full, atol=1e-3)
    assert copy.attention_layers() == [0, 1, 2, 4, 5] and copy.kinds[3].attention == "none"


def test_nemotron_kinds_and_bad_folders(tmp_path) -> None:
    model = load_checkpoint(write_tiny_nemotron(tmp_path / "nas"))
    assert [k.attention for k in model.kinds] == ["gqa", "gqa", "none", "gqa", "gqa"]
    assert [k.kv_heads for k in model.kinds] == [2, 2, 0, 2, 1]
    with pytest.raises(UserError, match="not a folder"):
        load_checkpoint(tmp_path / "missing")
