"""Remove attention from chosen layers of a Llama-family or Nemotron-NAS checkpoint, distill each such layer
locally (closed-form ridge refit of its FFN to the original layer's output, in layer order over the pruned
model's own stream), report quality against the unpruned model and surgery alone, and write a Nemotron-NAS
checkpoint (block_configs, sharded safetensors, the tokenizer copied) that every stage of this project takes.
"""

from __future__ import annotations

import json
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.cli import add_options, tool_parser
from runtime.prune.checkpoint import DTYPES
from runtime.prune.pipeline import PruneOptions, prune_checkpoint, run_tradeoff, show_importance
from runtime.prune.selection import format_layers, parse_layers

EPILOG = """\
examples:
  prune_attention.py ckpt/ --importance --plot importance.png      the table and the picture only
  prune_attention.py ckpt/ --layers 5-7,25-27 -o pruned/           exactly these layers
  prune_attention.py ckpt/ --remove 6 --runs 2 -o pruned/          the 6 cheapest, in 2 runs
  prune_attention.py ckpt/ --max-kl 0.5 -o pruned/                 as many as a summed KL of 0.5 allows
  prune_attention.py ckpt/ --layers 4-7 --linear -o pruned/        replace_with_linear instead of no_op
  prune_attention.py ckpt/ --layers 5-7 --e2e-steps 30 -o pruned/  then 30 end-to-end Adam steps (KL)
  prune_attention.py ckpt/ --tradeoff 2,4,6,8,10 --plot tradeoff.png   perplexity against layers removed

Importance is each attention layer's mean KL(original || model without that layer's attention) on
calibration text; the held-out text of the report (runtime/text_sets.py evaluation sets, prose and code)
is never calibrated on. --remove and --max-kl prefer runs of consecutive layers (fusion needs them).
The output folder must not exist; it is written staged and renamed into place at the end. Then:
  export_model.py --hf pruned/ -o model.onnx; analyze.py; fuse_onnx.py; heal.py; ... (README)
"""


def options() -> list[tuple[str, dict]]:
    files = {"type": Path, "nargs": "+", "metavar": "FILE"}
    d = PruneOptions()
    return [
        ("--importance", {"action": "store_true", "help": "print each layer's attention importance"}),
        ("--plot", {"type": Path, "metavar": "PNG", "help": "write the importance bar chart here"}),
        ("--layers", {"metavar": "LIST", "help": "layers to remove attention from, e.g. 5-7,25-27"}),
        ("--remove", {"type": int, "metavar": "K", "help": "remove the K least important attention layers"}),
        ("--runs", {"type": int, "metavar": "N", "help": "... in N runs of consecutive layers (K//3)"}),
        ("--max-kl", {"type": float, "metavar": "X", "help": "remove as many as summed KL X allows"}),
        ("--tradeoff", {"metavar": "COUNTS", "help": "measure only: perplexity for these numbers of layers "
                        "removed (e.g. 2,4,6,8), surgery and distilled; --plot draws it"}),
        ("--linear", {"action": "store_true", "help": "replace attention by a fitted Linear instead"}),
        ("--e2e-steps", {"type": int, "default": d.e2e_steps, "help": "end-to-end KL steps after it"}),
        ("--e2e-lr", {"type": float, "default": d.e2e_lr, "help": "their peak learning rate"}),
        ("--ridge", {"type": float, "default": d.ridge, "help": "refit regularization (heal's, relative)"}),
        ("--calib", {**files, "help": "calibration text files or one ids .npy (default: prose + code)"}),
        ("--heldout", {**files, "help": "held-out text files or one ids .npy (default: evaluation sets)"}),
        ("--tokens", {"type": int, "default": d.tokens, "help": "calibration tokens for the local fit"}),
        ("--importance-from", {"type": Path, "metavar": "JSON",
                               "help": "reuse the importance of a pruning.json (or of --importance --json)"}),
        ("--importance-tokens", {"type": int, "default": d.importance_tokens,
                                 "help": "calibration tokens for the importance ranking"}),
        ("--eval-tokens", {"type": int, "default": d.eval_tokens,
                           "help": "held-out tokens per text set for the report (0: no report)"}),
        ("--task-items", {"type": int, "default": d.task_items, "help": "license_mc items (0: none)"}),
        ("--window", {"type": int, "default": d.window, "help": "tokens per window"}),
        ("--dtype", {"choices": list(DTYPES), "help": "weights of the output (default: the source's)"}),
        ("--json", {"action": "store_true", "help": "print the result as JSON at the end"}),
        ("--quiet", {"action": "store_true", "help": "no progress messages"}),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("prune_attention.py", __doc__, EPILOG)
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder (Llama or Nemotron-NAS)")
    parser.add_argument("-o", "--output", type=Path, help="the Nemotron-NAS checkpoint folder to write")
    add_options(parser, options())
    args = parser.parse_args(argv)
    log = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
    layers = None if args.layers is None else parse_layers(args.layers)
    opts = PruneOptions(
        layers=layers, remove=args.remove, runs=args.runs, max_kl=args.max_kl, linear=args.linear,
        e2e_steps=args.e2e_steps, e2e_lr=args.e2e_lr, ridge=args.ridge, calib=tuple(args.calib or ()),
        heldout=tuple(args.heldout or ()), tokens=args.tokens, window=args.window,
        importance_tokens=args.importance_tokens, eval_tokens=args.eval_tokens, task_items=args.task_items,
        dtype=args.dtype, importance_from=args.importance_from,
    )
    if args.tradeoff is not None:
        if args.output is not None or any(v is not None for v in (layers, args.remove, args.max_kl)):
            raise UserError("--tradeoff measures only: no -o, --layers, --remove or --max-kl with it")
        counts = parse_layers(args.tradeoff)
        run_tradeoff(args.checkpoint, counts, args.plot, opts, log)
        return 0
    choosing = any(v is not None for v in (args.layers, args.remove, args.max_kl))
    if not choosing:
        if not args.importance:
            raise UserError("nothing to do: pass --importance, or --layers, --remove or --max-kl")
        if args.output is not None:
            raise UserError("-o needs a choice of layers (--layers, --remove or --max-kl)")
        show_importance(args.checkpoint, args.plot, opts, log, args.json)
        return 0
    if args.output is None and args.eval_tokens == 0:
        raise UserError("neither -o nor a report (--eval-tokens 0): nothing to do")
    result = prune_checkpoint(args.checkpoint, args.output, opts, log, plot=args.plot)
    if args.json:
        print(json.dumps(result.record(), indent=2))
    else:
        print(f"attention removed ({result.kind}) from layers {format_layers(result.layers)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
