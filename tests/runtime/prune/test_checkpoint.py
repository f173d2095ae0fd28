"""runtime/prune/checkpoint.py: the pruned model written as a Nemotron-NAS checkpoint reads back identical."""

from __future__ import annotations

import json

import pytest
import torch

from exporters.hf.config import read_config
from passes.errors import UserError
from runtime.prune.checkpoint import write_checkpoint
from runtime.prune.model import load_checkpoint
from tests.runtime.prune.fixtures import VOCAB, write_tiny_llama, write_tiny_nemotron


def test_llama_to_nemotron_nas(tmp_path) -> None:
    source = write_tiny_llama(tmp_path / "llama")
    (source / "tokenizer.json").write_text("{}")
    model = load_checkpoint(source)
    model.remove_attention(2)
    model.set_linear(3, torch.eye(64))
    record = {"removed_attention": [2, 3]}
    out = write_checkpoint(model, tmp_path / "out", "float32", record, shard_bytes=200_000)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["torch_dtype"] == "float32"
    blocks = config["block_configs"]
    assert [b["attention"]["no_op"] for b in blocks] == [False, False, True, False, False, False]
    assert blocks[3]["attention"]["replace_with_linear"] and blocks[0]["attention"]["n_heads_in_group"] == 2
    assert {b["ffn"]["ffn_mult"] for b in blocks} == {6.0}  # ceil256(int(2 * 6 * 64 / 3)) = 256
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert (out / "tokenizer.json").read_text() == "{}"
    assert json.loads((out / "pruning.json").read_text()) == {"removed_attention": [2, 3]}
    assert read_config(out).layers[3].attention == "linear"
    again = load_checkpoint(out)
    ids = torch.randint(4, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again.forward(ids), model.forward(ids))
    with pytest.raises(UserError, match="exists"):
        write_checkpoint(model, out, "float32", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "out"]  # nothing staged left behind


def test_nemotron_source_bf16(tmp_path) -> None:
    model = load_checkpoint(write_tiny_nemotron(tmp_path / "nas"))
    model.remove_attention(0)
    out = write_checkpoint(model, tmp_path / "out", "bfloat16", {})
    config = read_config(out)
    assert [layer.attention for layer in config.layers] == ["none", "gqa", "none", "gqa", "gqa"]
    assert [layer.kv_heads for layer in config.layers] == [0, 2, 0, 2, 1] and config.dtype == "bfloat16"
    again = load_checkpoint(out)
    ids = torch.randint(4, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = again.forward(ids), model.forward(ids)
    assert torch.allclose(a, b, atol=0.1 * b.abs().max())


def test_width_not_expressible(tmp_path) -> None:
    source = write_tiny_llama(tmp_path / "llama")
    config = json.loads((source / "config.json").read_text())
    model = load_checkpoint(source)
    model.config.layers[0] = type(model.config.layers[0])("gqa", 2, "swiglu", 200)
    with pytest.raises(UserError, match="multiples of 256"):
        write_checkpoint(model, tmp_path / "out", "float32", {})
    assert not (tmp_path / "out").exists() and config
