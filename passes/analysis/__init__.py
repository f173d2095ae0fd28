"""Which blocks depend on each other (the paper's section 3 metric) and the plan it proposes.

cut.py cuts the graph into one subgraph per block, runner.py runs them (streaming models larger than RAM),
dependency.py measures the dependency matrix and block statistics, heatmap.py draws the matrix, and
propose.py turns it into a fusion plan."""
