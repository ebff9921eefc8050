"""Answer quality of the sparse methods, measured on the real model: what `ctxcache bench`
reports and the methods' tests assert.

- `texts`: the filler documents (`corpus/`: prose, code, six kinds and the wide suite's five, with
  their licenses; `dpkglog_gen` writes the one generated, the dpkg log);
- `capture`: a dense prefill that keeps each layer's Q/K/V; `selection`: a method's selection
  against the true top-K on them (mass and top-K recall, output error); `step_bytes`: the
  bytes a decode step reads; `model_scores`: sparse decode through the whole model against
  full attention (top-1 agreement, NLL, passkey);
- `tasks`: RULER-style long-context tasks; `copy_tasks` and `retention`: questions answered by
  copying from a cached context, and the fraction of full attention's answers each method keeps;
  `wide_tasks`, `wide_templates`, `retention_suites`, `retention_cells`: the number-dense suite
  (issue 45), which suite asks what, and the cells its report shows.

It may import the core and the decoder (its tasks decode with the reference runner); only the
benchmarks and the tests import it."""
