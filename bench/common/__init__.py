"""Helpers shared by several benchmarks (not benchmarks themselves): GPU inputs and arguments,
result files, a fleet of servers, the re-prefill baseline, the serving limits. What the tests
use too is the package's: quality/ (texts, capture, selection, model scores, tasks, retention),
client/server_process.py, ctxcache/kernels/timing.py."""
