"""Helpers shared by the benchmarks (not benchmarks themselves): texts, capture of real Q/K/V,
selection metrics, model-level scores, the task suite, GPU inputs and timing, result files."""
