"""Helpers shared by several benchmarks (not benchmarks themselves): model-level scores, GPU
inputs and timing, result files, the servers they start. What the tests use too (texts, capture,
selection, tasks, retention) is the package's: quality/."""
