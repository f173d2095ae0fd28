"""TorchScript (legacy torch.onnx) export of a Hugging Face causal LM folder: input_ids -> logits.

Run as a script by tests/corpora/third_party.py in the Optimum venv (transformers 4.57, docs/design.md §5),
so it
imports nothing of this project. transformers' mask code does not trace under TorchScript (vmap, and
aten::diff in find_packed_sequence_indices): the vmap-free mask functions Optimum ships are registered and
the packed-sequence search is switched off (inputs are never packed here), as Optimum's own patcher does.

    python tests/corpora/torchscript_hf.py HF_FOLDER OUT.onnx OPSET
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers.masking_utils as masking
from optimum.exporters.onnx.model_patcher import eager_mask_without_vmap, sdpa_mask_without_vmap
from transformers import AutoModelForCausalLM


def export(folder: str, out: str, opset: int) -> None:
    masking.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", sdpa_mask_without_vmap)
    masking.ALL_MASK_ATTENTION_FUNCTIONS.register("eager", eager_mask_without_vmap)
    masking.find_packed_sequence_indices = lambda position_ids: None
    model = AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            _Logits(model), (torch.zeros(2, 7, dtype=torch.int64),), out, dynamo=False, opset_version=opset,
            input_names=["input_ids"], output_names=["logits"],
            dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}},
        )


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


if __name__ == "__main__":
    export(sys.argv[1], sys.argv[2], int(sys.argv[3]))
