"""The 8xH100/H200 decode latency model (docs/latency_model.md): predict.py (one decode step from block
shapes), paper_models.py (the paper's models), fit.py (the two fitted constants), report.py, constants.py."""
