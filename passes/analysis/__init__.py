"""Which blocks depend on each other (the paper's section 3 metric) and the plan it proposes."""
