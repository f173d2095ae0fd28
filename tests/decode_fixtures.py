"""Tiny decode-graph models shared by tests/exporters/test_decode.py, tests/runtime and tests/tools.

Each model is exported on first use into the artifact cache (tests/artifacts.py), so every test folder
and pytest-xdist worker shares one export. Import as `from tests import decode_fixtures`.
"""

from __future__ import annotations

from pathlib import Path

from exporters.spec import BlockSpec, ModelSpec
from passes.pipeline import fuse_file
from passes.plan import Plan
from tests.artifacts import artifact

TINY_SEED = 1
# Attention at blocks 0 and 4: groups [0, 2] and [4, 6] are valid (only a group's first block has attention).
TINY_GROUPS = ((0, 2), (4, 6))
TINY_CACHE_LAYERS = (0, 4)


def tiny_spec() -> ModelSpec:
    """Hidden 64, GQA 4:2, untied lm_head (so greedy tokens vary), every FFN width different."""
    widths = [96, 64, 80, 48, 72, 56, 40]
    attention = [True, False, False, False, True, False, False]
    return ModelSpec(
        hidden=64,
        heads=4,
        kv_heads=2,
        vocab=96,
        tie_embeddings=False,
        blocks=[BlockSpec(a, w) for a, w in zip(attention, widths, strict=True)],
    )


def torch_greedy(prompt: list[int], steps: int) -> list[int]:
    """The tiny model's greedy tokens as the argmax of a full-sequence torch re-run at every step: no cache,
    no ONNX, no server (the independent reference of tests/runtime/test_generate.py and test_serve.py)."""
    import torch  # noqa: PLC0415 (torch: seconds to import; only the torch reference needs it)

    from exporters.llama import build_model  # noqa: PLC0415 (imports torch: only the torch reference needs it)

    model = build_model(tiny_spec(), TINY_SEED)
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    return sequence[len(prompt) :]


def decode_models(name: str) -> Path:
    """Tiny model `name`: "decode", "prefill", "decode_fused" or "prefill_fused" (plan TINY_GROUPS, fold),
    exported once for every test and worker (tests/artifacts.py)."""
    if name not in MODELS:
        raise KeyError(name)
    return artifact(f"tiny_{name}", _build, name) / f"tiny_{name}.onnx"


MODELS = ("decode", "prefill", "decode_fused", "prefill_fused")


def _build(folder: Path, name: str) -> None:
    from exporters.decode import export_spec_decode  # noqa: PLC0415 (torch: seconds to import; only when the export is not cached)
    from exporters.onnx_export import export_spec_model  # noqa: PLC0415 (torch: seconds to import; only when the export is not cached)

    path = folder / f"tiny_{name}.onnx"
    if name == "decode":
        export_spec_decode(tiny_spec(), path, seed=TINY_SEED)
    elif name == "prefill":
        export_spec_model(tiny_spec(), path, seed=TINY_SEED)
    else:
        source = decode_models(name.removesuffix("_fused"))
        fuse_file(source, Plan(TINY_GROUPS, "fold"), path)  # validated, as fuse_onnx.py does
