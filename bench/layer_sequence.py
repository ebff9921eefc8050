"""Per-layer attention inside a sequence of layers, as a decode step runs them: SDPA (flash)
against CSAttention (int8 tables, the default), each layer with its own q, K/V and tables;
CSAttention also with every launch's inputs loaded after its PDL wait (`_loads_after_wait`, the
measure of the pre-wait loads, kernels/sync.py).

Why: `bench attention` times one layer per CUDA-graph replay, so each of its times includes
the graph's own start (a one-launch graph costs ~5.4 us in that harness on the H100,
bench/floor.py) that a decode step pays once for all its layers. Here one graph runs L layers
back to back, with one selector for all of them (as GpuSparseAttention); per layer =
T(L) / L, and the marginal cost (T(L) - T(1)) / (L - 1) leaves the graph's start out entirely.

Two protocols (same timing helper as the other benches: median replay, L2 emptied before each
the way --flush says):
- `back_to_back`: the layers follow each other directly. The selector's small buffers (16-bit
  keys, workspace, indices) stay in L2 from one layer to the next.
- `l2_flush`: 64 MB (more than the H100's 50 MB L2) written (--flush write) or read (--flush
  read) before every layer evicts L2 as a model's weight reads between two attention layers
  would; the same sequence of evictions alone is timed too and subtracted.

`python -m ctxcache.bench.layer_sequence [--contexts 32768,131072] [--batches 1,8] [--layers 8] [--flush write|read]
[--out DIR]`
(`ctxcache bench layer_sequence`, `bench/gpu_suite.sh sequence`)."""

from __future__ import annotations

import argparse

import torch

from ctxcache.bench.attention import attend, sdpa_dense
from ctxcache.bench.fused_tune import Case
from ctxcache.bench.gpu_inputs import D, HKV, gpu_cli, grid_points
from ctxcache.bench.step_probe import timed
from ctxcache.decoder.gpu.timing import FLUSHES, capture, device_info, flush_mode, print_table, time_us, write_results
from ctxcache.methods import Budget

FLUSH_BYTES = 64 << 20
MEMORY_SHARE = 0.55  # of the GPU's memory for the layers held at once (45 GB on an 80 GB H100)


def layer_bytes(n: int, batch: int) -> int:
    """One layer's K/V (bf16) and int8 dense tables (m = 8 rows of C = 128 per KV head)."""
    return batch * HKV * n * (2 * D * 2 + 8 * 128)


def sequence_rows(n: int, batch: int, budget: Budget, max_layers: int) -> list[dict]:
    budget_bytes = MEMORY_SHARE * torch.cuda.get_device_properties(0).total_memory
    layers = min(max_layers, int(budget_bytes // layer_bytes(n, batch)))
    if layers < 2:
        raise SystemExit(f"{n} keys x batch {batch}: two layers ({2 * layer_bytes(n, batch) / 1e9:.1f} GB) do not fit "
                         f"in {budget_bytes / 1e9:.1f} GB; use fewer contexts or batches")
    cases = [Case(n, batch, budget, "int8") for _ in range(layers)]
    sel = cases[0].selector(None, None)
    late = cases[0].selector(None, None)  # every launch's inputs loaded after its PDL wait
    late.pre_wait = False
    splits = cases[0].splits
    scratch = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    evict = scratch.zero_ if flush_mode() == "write" else scratch.sum
    steps = {
        "dense_sdpa_flash": lambda c: sdpa_dense(c.q[:, :, None], c.k, c.v),
        "csattention": lambda c: attend(c.q, c.k, c.v, c.nt, sel.select(c.q, c.tables, c.lo, c.hi, c.kk), c.kk,
                                        budget, splits, sel.pdl),
        "csattention_loads_after_wait": lambda c: attend(
            c.q, c.k, c.v, c.nt, late.select(c.q, c.tables, c.lo, c.hi, c.kk), c.kk, budget, splits, late.pdl,
            pre_wait=False),
        "flush_only": lambda c: None,
    }

    def run(step, count: int, flush: bool) -> float:
        def body():
            for c in cases[:count]:
                if flush:
                    evict()
                step(c)
        return timed(body)

    base = {"context": n, "batch": batch, "layers": layers, "top_k": cases[0].top_k}
    # one layer under each way of emptying L2 (none: warm, the check that the others evict)
    rows = [{**base, "method": name, "protocol": f"one_layer_flush_{mode}",
             "time_us": time_us(capture(lambda: step(cases[0])).replay, flush=mode)}
            for name, step in list(steps.items())[:3] for mode in FLUSHES]
    for protocol, flush in (("back_to_back", False), ("l2_flush", True)):
        t = {(name, count): run(step, count, flush) for name, step in steps.items() for count in (1, layers)
             if flush or name != "flush_only"}
        for name in ("dense_sdpa_flash", "csattention", "csattention_loads_after_wait"):
            own = {count: t[name, count] - t.get(("flush_only", count), 0.0) for count in (1, layers)}
            rows.append({**base, "method": name, "protocol": protocol, "one_layer_us": own[1],
                         "sequence_us": own[layers], "time_us": own[layers] / layers,
                         "marginal_us": (own[layers] - own[1]) / (layers - 1),
                         "flush_us": t.get(("flush_only", layers))})
    del cases
    return rows


def with_speedups(rows: list[dict]) -> list[dict]:
    """Add SDPA / CSAttention (per layer, marginal, one layer) to the CSAttention rows."""
    for r in rows:
        if not r["method"].startswith("csattention"):
            continue
        d = next(x for x in rows if x["method"] == "dense_sdpa_flash" and
                 all(x[k] == r[k] for k in ("context", "batch", "protocol")))
        r["speedup_per_layer"] = d["time_us"] / r["time_us"]
        if "marginal_us" in r:
            r["speedup_marginal"] = d["marginal_us"] / r["marginal_us"]
            r["speedup_one_layer"] = d["one_layer_us"] / r["one_layer_us"]
    return rows


def main(argv: list[str] | None = None) -> int:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--layers", type=int, default=8, help="layers per sequence (fewer where memory is short)")
    args = gpu_cli("ctxcache bench layer_sequence", "32768,131072", argv, extra)
    if args is None:
        return 2
    rows = []
    for b, n in grid_points(args):
        got = with_speedups(sequence_rows(n, b, Budget(), args.layers))
        print_table(got, ["context", "batch", "layers", "protocol", "method", "one_layer_us", "time_us",
                          "marginal_us", "speedup_per_layer", "speedup_marginal"])
        rows += got
    path = write_results("layer_sequence", rows, {"flush_bytes": FLUSH_BYTES}, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
