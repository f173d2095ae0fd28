"""Healing: blockwise local distillation of fused weights towards the original blocks."""
