"""Which blocks depend on each other (the paper's section 3 metric) and the plan it proposes.

The blocks run through passes/run/ (BlockRunner). dependency.py measures the dependency matrix and block
statistics, heatmap.py draws the matrix, and
propose.py turns it into a fusion plan."""
