"""SmolLM2-135M as a Hugging Face folder (config.json, model.safetensors, tokenizer, generation_config.json).

Third-party exporters (Optimum, ONNX Runtime GenAI's builder, torch.onnx) read a model from such a folder.
The recipe is design §5's: transformers 5 refuses `save_pretrained` on the GGUF-loaded model, so a plain
model is built with `from_config`, the loaded weights are copied in with a strict `load_state_dict`, and
that is saved; config.json also gets a top-level `rope_theta` (transformers 4.57, Optimum's, otherwise
uses 10000) and the tokenizer is saved as `PreTrainedTokenizerFast` (4.57 cannot load `TokenizersBackend`).

`drop_attention` makes the Nemotron-NAS shape (docs/design.md §3b) expressible in a plain Llama folder: those
layers' `o_proj` weights are zero, so the attention sub-block adds exactly 0 to the stream and the folder,
loaded by any transformers, computes h + mlp(post_attention_layernorm(h)) there. The layer list is
recorded in config.json under `DROPPED_ATTENTION_KEY`; exporters remove those sub-blocks (and their input
norms) from the model before export or from the graph after it (tests/corpora/third_party.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from exporters.smollm2 import check_blocks, load_torch_model
from exporters.smollm2_tokenizer import load_tokenizer
from passes.metadata import DROPPED_ATTENTION_KEY

ROPE_THETA = 100000.0  # SmolLM2's (docs/design.md §5)


def save_smollm2(folder: Path, drop_attention: Sequence[int] = ()) -> Path:
    """Write SmolLM2-135M-Instruct (float32) as a Hugging Face folder; returns `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dropped = check_blocks(drop_attention)
    loaded = load_torch_model()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    for layer in dropped:
        state[f"model.layers.{layer}.self_attn.o_proj.weight"] = torch.zeros_like(
            state[f"model.layers.{layer}.self_attn.o_proj.weight"])
    plain.load_state_dict(state, strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(folder)
    _patch_config(folder / "config.json", dropped)
    _save_tokenizer(folder)
    return folder


def _patch_config(path: Path, dropped: list[int]) -> None:
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    theta = (config.get("rope_parameters") or {}).get("rope_theta", ROPE_THETA)
    config["rope_theta"] = theta
    config[DROPPED_ATTENTION_KEY] = dropped
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(folder: Path) -> None:
    load_tokenizer().save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")
