"""Small Llama graphs in the attention and export forms other exporters write (for the sharding tests).

Each is the hand-written exporters/llama.py model with another attention body, exported by torch.onnx
(dynamo at opset 18 or 23, or TorchScript at opset 17), or the TorchScript export run through ONNX
Runtime's transformers optimizer. Heads are SmolLM2's (9 query heads, 3 KV heads) at head_dim 8, so no
tp in {2, 4, 8} divides them. Built once and cached (`forms_model`, tests/artifacts.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnxruntime.transformers.optimizer import optimize_model

from exporters.spec import BlockSpec, ModelSpec
from tests.artifacts import artifact

# blocks: attention + FFN, attention-free FFN, attention + FFN (widths 40, 36, 44: 8 divides none)
FORM_BLOCKS = ((True, 40), (False, 36), (True, 44))
VOCAB = 96


def forms_spec():
    blocks = [BlockSpec(attention=a, ffn_width=w) for a, w in FORM_BLOCKS]
    return ModelSpec(hidden=72, heads=9, kv_heads=3, vocab=VOCAB, blocks=blocks, tie_embeddings=False)


def _attention_classes():
    import torch  # noqa: PLC0415 (torch: seconds to import; only to build a form or the torch reference)
    import torch.nn.functional as F  # noqa: PLC0415 (torch: only when a form is not cached)
    from torch import nn  # noqa: PLC0415 (torch: only when a form is not cached)

    from exporters.llama import SelfAttention, rotate_half  # noqa: PLC0415 (imports torch: only when a form is not cached)

    class WhereMask(SelfAttention):
        """HF/Optimum style: repeat_kv by Expand + Reshape, mask by masked_fill (Where), IsNaN guard."""

        def attend(self, q, k, v, mask):
            b, kv, s, d = k.shape
            group = self.heads // self.kv_heads
            k = k[:, :, None].expand(b, kv, group, s, d).reshape(b, self.heads, s, d)
            v = v[:, :, None].expand(b, kv, group, s, d).reshape(b, self.heads, s, d)
            scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5)
            scores = scores.masked_fill(mask != 0, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            probs = torch.where(torch.isnan(probs), torch.zeros_like(probs), probs)
            out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
            return self.o_proj(out)

    class RepeatInterleave(SelfAttention):
        """GQA by repeat_interleave, additive mask."""

        def attend(self, q, k, v, mask):
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5 + mask, dim=-1)
            out = torch.matmul(probs, v).transpose(1, 2)
            return self.o_proj(out.reshape(out.shape[0], out.shape[1], -1))

    class Sdpa(SelfAttention):
        """F.scaled_dot_product_attention with GQA: the Attention op at opset 23."""

        def attend(self, q, k, v, mask):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out = out.transpose(1, 2)
            return self.o_proj(out.reshape(out.shape[0], out.shape[1], -1))

    class PackedQkv(WhereMask):
        """One qkv projection split on the last axis (Phi-3 style)."""

        def __init__(self, spec) -> None:
            super().__init__(spec)
            q, k = self.q_proj, self.k_proj
            self.qkv_proj = nn.Linear(spec.hidden, q.out_features + 2 * k.out_features, bias=False)
            del self.q_proj, self.k_proj, self.v_proj

        def project(self, x, cos, sin):
            q_cols, kv_cols = self.heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_cols, kv_cols, kv_cols], dim=-1)
            q = q.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
            k = k.unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
            v = v.unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    return {"where": WhereMask, "repeat": RepeatInterleave, "sdpa": Sdpa, "packed": PackedQkv}


# name -> (attention class, exporter, opset)
FORMS = {
    "dynamo_where": ("where", "dynamo", 18),
    "dynamo_repeat": ("repeat", "dynamo", 18),
    "dynamo_packed": ("packed", "dynamo", 18),
    "opset23_attention": ("sdpa", "dynamo", 23),
    "torchscript": ("where", "torchscript", 17),
    "torchscript_repeat": ("repeat", "torchscript", 17),
    "ort_optimized": ("where", "ort_optimizer", 18),  # dynamo_where through ORT's optimizer
}


def build_torch(attention: str, seed: int = 4):
    from exporters.llama import DecoderBlock, build_model  # noqa: PLC0415 (imports torch: only when a form is not cached)

    cls = _attention_classes()[attention]
    original = DecoderBlock.attention_class
    DecoderBlock.attention_class = cls
    try:
        return build_model(forms_spec(), seed)
    finally:
        DecoderBlock.attention_class = original


def export_form(name: str, path: Path) -> Path:
    from exporters.onnx_export import export_onnx  # noqa: PLC0415 (imports torch: only when a form is not cached)

    attention, exporter, opset = FORMS[name]
    if exporter == "dynamo":
        export_onnx(build_torch(attention), path, opset=opset, external_data_threshold=1 << 40)
    elif exporter == "torchscript":
        _torchscript_export(build_torch(attention), path, opset)
    else:  # Skip/SimplifiedLayerNormalization for the residual adds and norms
        spec = forms_spec()
        source = forms_model("dynamo_where")
        optimized = optimize_model(
            str(source), model_type="gpt2", num_heads=spec.heads, hidden_size=spec.hidden, opt_level=0
        )
        optimized.save_model_to_file(str(path))
    return path


def _torchscript_export(model, path: Path, opset: int) -> None:
    import torch  # noqa: PLC0415 (torch: seconds to import; only to build a form or the torch reference)

    from exporters.onnx_export import quiet_export  # noqa: PLC0415 (imports torch: only when a form is not cached)

    with quiet_export(), torch.no_grad():
        torch.onnx.export(
            model,
            (torch.zeros((2, 8), dtype=torch.int64),),
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}},
        )


def forms_model(name: str) -> Path:
    """The graph `name` of FORMS, exported once (tests/artifacts.py)."""
    return artifact(f"form_{name}", _export_into, name) / f"{name}.onnx"


def _export_into(folder: Path, name: str) -> None:
    export_form(name, folder / f"{name}.onnx")


def torch_logits(attention: str, ids: np.ndarray) -> np.ndarray:
    """The same model in torch (float64), an independent reference for the exported graphs."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only to build a form or the torch reference)

    model = build_torch(attention).double()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).numpy()
