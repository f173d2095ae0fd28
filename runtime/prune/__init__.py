"""Attention pruning with blockwise local distillation (issue 35): a Llama-family or Nemotron-NAS checkpoint
in, a Nemotron-NAS checkpoint with some layers' attention removed (no_op) or replaced by one Linear out.

One module per idea: `model` (the checkpoint as a torch model, run layer by layer), `importance` (each
layer's attention importance), `selection` (which layers), `distill` (the closed-form local refit, optional
end-to-end steps), `checkpoint` (writing the Nemotron-NAS folder), `report` (the quality table), and
`pipeline` (the whole run behind tools/prune_attention.py)."""
