"""Healing: blockwise local distillation of fused weights towards the original blocks.

Entry points: report.run_heal (tools/heal.py) and costs.HealedCosts (tools/analyze.py --heal).
distill.heal fits group after group: pair.py checks the two models, streams.py captures the original's
streams, ffn.py holds a fused group's FFN in torch (parallel.py: a parallel group's member FFNs), fit.py
fits it, write.py writes the healed model. input_limits.py reads the batch and sequence dims the graphs
accept; transplant.py carries a heal's weights into another graph of the same model and plan (the decode
graph: tools/heal.py --weights-from)."""
