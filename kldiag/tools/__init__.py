"""Tools: the estimator lab, the demo, and synthetic runs with a known truth (for tests and benchmarks)."""
