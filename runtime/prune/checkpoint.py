"""Writing a pruned model as a Nemotron-NAS (DeciLM) checkpoint (design §7): config.json with block_configs
spelled as the released configs spell them (exporters.hf.synthetic.deci_block), sharded safetensors with
model.safetensors.index.json, the source's tokenizer and generation files copied, and pruning.json (what
was removed and the quality report). Written into a staged folder beside the target and renamed into
place at the end, so an error leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from exporters.hf.config import expected_tensors, read_config
from exporters.hf.synthetic import deci_block, nemotron_config
from exporters.spec import ffn_width
from passes.errors import UserError
from runtime.prune.model import PruneModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 256 * 2**20
# Files of a checkpoint folder that are its weights or its config, not copied from the source.
NOT_COPIED = {"config.json", INDEX_FILE, "pruning.json"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def check_output(out: Path) -> None:
    """UserError unless `out` can be created (it must not exist yet; its parent may be created)."""
    if out.exists():
        raise UserError(f"{out} exists; choose a new folder with -o (nothing is overwritten)")


def ffn_mult(width: int, hidden: int) -> float:
    """The ffn_mult that Nemotron-NAS turns back into `width` (ceil256(int(2 * mult * hidden / 3)))."""
    mult = width * 3 / (2 * hidden)
    if ffn_width(mult, hidden) != width:
        raise UserError(
            f"an FFN width of {width} (hidden {hidden}) cannot be written as a Nemotron-NAS ffn_mult: "
            "its widths are multiples of 256"
        )
    return mult


def nemotron_nas_config(model: PruneModel, dtype: str) -> dict:
    """config.json of the pruned model: the source's own when it is Nemotron-NAS, else one built from the
    Llama config; block_configs from the current layer kinds."""
    config, raw = model.config, model.config.raw
    hidden = config.hidden
    if config.head_dim != hidden // config.heads:
        raise UserError(f"head_dim {config.head_dim} != hidden_size / num_attention_heads: Nemotron-NAS "
                        "configs cannot express it")
    blocks = []
    for i, kind in enumerate(model.kinds):
        source = raw["block_configs"][i] if config.is_deci else None
        if kind.attention == "gqa":
            attention: str | int = config.heads // kind.kv_heads
        else:
            attention = "no_op" if kind.attention == "none" else "linear"
        if kind.ffn == "swiglu":
            width = config.layers[i].ffn_width
            ffn: str | float = source["ffn"]["ffn_mult"] if source else ffn_mult(width, hidden)
        else:
            ffn = "no_op" if kind.ffn == "none" else "linear"
        blocks.append(deci_block(attention, ffn))
    if config.is_deci:
        out = dict(raw)
        out["block_configs"] = blocks
    else:
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or None
        if rope and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        elif rope:
            rope = {k: v for k, v in rope.items() if k != "rope_theta"}
        out = nemotron_config(blocks, hidden=hidden, heads=config.heads, vocab=config.vocab,
                              rope_scaling=rope, tie=config.tie_embeddings, rope_theta=config.rope.theta)
        out.pop("auto_map")  # no modeling code is shipped; the project's exporters read the folder
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
            if key in raw:
                out[key] = raw[key]
        out["rms_norm_eps"] = raw.get("rms_norm_eps", config.eps)
    out["num_hidden_layers"] = len(blocks)
    out["torch_dtype"] = dtype
    out.pop("dtype", None)
    return out


def write_checkpoint(model: PruneModel, out: Path, dtype: str, record: dict,
                     shard_bytes: int = SHARD_BYTES) -> Path:
    """The pruned model as a Nemotron-NAS checkpoint folder `out` (module docstring); returns `out`."""
    check_output(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    config = nemotron_nas_config(model, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staged / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        names = list(expected_tensors(read_config(staged)))
        state = model.net.state_dict()
        shards: list[list[str]] = [[]]
        size = 0
        for name in names:
            nbytes = state[name].numel() * DTYPES[dtype].itemsize
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        weight_map, total = {}, 0
        for k, group in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {n: state[n].detach().to(DTYPES[dtype]).contiguous() for n in group}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(staged / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, file))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staged / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for path in sorted(model.folder.iterdir()):
            copied = path.name not in NOT_COPIED and not path.name.endswith(WEIGHT_SUFFIXES)
            if path.is_file() and copied:
                shutil.copy2(path, staged / path.name)
        (staged / "pruning.json").write_text(json.dumps(record, indent=2) + "\n")
        os.chmod(staged, 0o755)
        check_output(out)
        staged.rename(out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out
