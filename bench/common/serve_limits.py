"""What `bench serve` sets each served number against: the mode's bandwidth floor (weights plus the
bytes one step must read per row, at the card's measured copy bandwidth) and the runner's own
step (GpuRunner.step on the same batch: graph replay, no engine, no gRPC), plus the streams'
inter-token gaps as the client sees them."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.config import ModelArgs
from ctxcache.models.loader import LoadedModel


def copy_bandwidth(device: str, gib: int = 2) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written (median of 10)."""
    if device != "cuda":
        return 0.0
    src = torch.empty(gib << 28, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / statistics.median(times[2:])


def row_bytes(a: ModelArgs, params: CSAttentionParams | None, config: SparseConfig, n_ctx: int,
              elem: int) -> int:
    """K/V-side bytes one decode step reads for one row of n_ctx keys, over every layer. Dense:
    every key's K and V. Sparse: the int8 score rows (one byte per subspace, key and KV head),
    the re-rank's candidates' K, and K and V of the selection, sinks and recent window."""
    kv_row = a.head_dim * elem  # one key's K (or V) for one KV head
    if params is None:
        per_head = 2 * n_ctx * kv_row
    else:
        b = config.budget
        lo, hi = b.region(n_ctx)
        k = min(b.top_k(n_ctx), hi - lo)
        kc = params.candidates(k, hi - lo) if params.rerank > 1 else 0
        per_head = n_ctx * params.subspaces + kc * kv_row + 2 * (k + b.sinks + b.recent) * kv_row
    return a.n_layers * a.n_kv_heads * per_head


def weight_bytes(lm: LoadedModel) -> int:
    return sum(p.numel() * p.element_size() for p in lm.model.parameters())


def floor_ms(weights: int, per_row: int, rows: int, bandwidth: float) -> float:
    return 1e3 * (weights + rows * per_row) / bandwidth if bandwidth else 0.0


def runner_steps_ms(lm: LoadedModel, art, params: CSAttentionParams | None, config: SparseConfig,
                    streams: list[int], max_len: int, repeats: int = 20) -> tuple[dict[int, float], float]:
    """Median GpuRunner.step time per batch size, each row a slot holding `art`, and the median
    admission of a 20-token question on a resident slot (its prefill, replayed), ms."""
    runner = GpuRunner(lm, params, config, max(streams), max_len)
    out = {}
    try:
        rows = [runner.admit(f"c{i}", art, [5] * 20, config, 64)[0] for i in range(max(streams))]
        prefill = 1e3 * statistics.median(_timed_admission(runner, rows[0], art, config) for _ in range(repeats))
        for s in streams:
            out[s] = 1e3 * median_step_s(runner, rows[:s], repeats)
            for r in rows[:s]:  # back to the context's end: every repeat steps the same positions
                runner.release(r)
                runner.admit(r.context_id, art, [5] * 20, config, 64)
    finally:
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    return out, prefill


def median_step_s(runner: GpuRunner, rows: list, repeats: int = 20) -> float:
    """The median wall time of the runner's step over `rows` (after 3 untimed steps), seconds."""
    toks = [7] * len(rows)
    for _ in range(3):
        runner.step(rows, toks)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step(rows, toks)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed_admission(runner: GpuRunner, row, art, config: SparseConfig) -> float:
    runner.release(row)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.admit(row.context_id, art, [5] * 20, config, 64)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def gaps_ms(arrivals: list[float]) -> list[float]:
    """Inter-token gaps (ms) of one stream from its token arrival times (s)."""
    return [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:])]


def h2d_gb_per_s(gib: int = 2) -> float:
    """Pinned host -> device copy rate (median of 5 after 2 warm-ups)."""
    src = torch.empty(gib << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    return (gib << 30) / statistics.median(times[2:]) / 1e9
