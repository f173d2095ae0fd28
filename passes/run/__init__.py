"""Running a decoder graph block by block: cut.py cuts the graph into blocks (one subgraph per block, with
the side tensors it reads), block_runner.py runs them (BlockRunner) or the whole model with bounded memory
(model_logits). Validation, evaluation, analysis and healing all run blocks through this package."""
