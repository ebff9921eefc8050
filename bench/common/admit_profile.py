"""`bench step_profile --admit`: a context's hot admission (a 20-token question on a context its
slot already holds) timed and profiled: resident (modes sparse, dense: the fast runner's prefill
graphs), and offloaded (mode offload) by the serial host copy against the pipelined one
(offload_prefill: V copied a layer ahead on its own stream) and, with `--graphs`, the serial one
replayed as CUDA graphs (offload_prompt: the question padded to 32 tokens).

Why: issue 47's hot TTFT target is <= 50 ms at 32K; the admission's V (2.2 GB at Llama-3.1-8B
bf16) crosses PCIe in ~40 ms and its kernels take ~11 ms (H200), so it meets the target only when
the two overlap and the host's launches keep up. Per admission: its wall time (the runner's admit,
synchronised), the bytes it copied from the host (`pcie.prefill`), from torch.profiler the time
the host -> device copies were busy, the time kernels were busy, and how much of the two
coincided (the overlap), beside the link's measured rate (what the copies alone would take); a
cProfile of one admission's host functions; with a trace folder, each profiled admission's
Chrome trace."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.gpu.offload_runner import OffloadRunner

QUESTION = [5] * 20  # a question's tokens (the 20-30)


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, end) intervals -> their union as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def busy(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    return sum(e - s for s, e in merged(intervals))


def overlap(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Length of the time both a's union and b's union cover."""
    ua, ub, total, j = merged(a), merged(b), 0.0, 0
    for s, e in ua:
        while j < len(ub) and ub[j][1] <= s:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < e:
            total += min(e, ub[k][1]) - max(s, ub[k][0])
            k += 1
    return total


def device_activity(events) -> dict:
    """Kineto events -> ms the host -> device copies and the kernels were busy, both at once,
    and from the first to the last device event of any kind; the copies' and kernels' stream ids."""
    copies, kernels, every, copy_streams, kernel_streams = [], [], [], set(), set()
    for e in events:
        if e.device_type().name != "CUDA":
            continue
        span = (e.start_ns() / 1e6, e.end_ns() / 1e6)
        every.append(span)
        if "HtoD" in e.name():
            copies.append(span)
            copy_streams.add(e.device_resource_id())
        elif "Memcpy" not in e.name() and "Memset" not in e.name():
            kernels.append(span)
            kernel_streams.add(e.device_resource_id())
    return {"h2d_busy_ms": busy(copies), "kernels_busy_ms": busy(kernels), "overlap_ms": overlap(copies, kernels),
            "device_span_ms": max(e for _, e in every) - min(s for s, _ in every) if every else 0.0,
            "copy_streams": sorted(copy_streams), "kernel_streams": sorted(kernel_streams)}


def hot_admit_ms(runner, art: ContextArtifact, repeats: int) -> tuple[float, int]:
    """Median wall ms of `repeats` hot admissions (each released after) and the bytes each
    copied from the host (0 on the fast runner)."""
    times, moved = [], 0
    pcie = getattr(runner, "pcie", None)  # the offload runner's (a resident admission copies nothing)
    for _ in range(repeats):
        before = pcie.prefill if pcie is not None else 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        row, _ = runner.admit("hot", art, QUESTION, runner.config, 64)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
        moved = pcie.prefill - before if pcie is not None else 0
        runner.release(row)
    return statistics.median(times), moved


def profile_admit(runner, art: ContextArtifact,
                  trace: Path | None = None) -> tuple[dict, list[tuple[str, float]]]:
    """One hot admission under torch.profiler: its device activity and its (kernel, us) events.
    trace: also the host's CUDA API calls, the whole timeline written there as a Chrome trace
    (where a launch or copy call blocks the host, or a stream waits on the other)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace is not None else [])
    with profile(activities=activities) as prof:
        row, _ = runner.admit("hot", art, QUESTION, runner.config, 64)
        torch.cuda.synchronize()
    runner.release(row)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    events = prof.profiler.kineto_results.events()
    kernels = [(e.name(), e.duration_ns() / 1e3) for e in events if e.device_type().name == "CUDA"]
    return device_activity(events), kernels


def host_profile(runner, art: ContextArtifact, top: int = 25) -> tuple[float, list[dict]]:
    """One hot admission under cProfile: its host wall ms (cProfile's own overhead included) and
    the `top` functions by their own time, with calls (a launch-bound admission shows its launch
    sites here, which the device profile cannot attribute)."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    row, _ = runner.admit("hot", art, QUESTION, runner.config, 64)
    prof.disable()
    host_ms = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    runner.release(row)
    stats = pstats.Stats(prof).stats
    funcs = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return host_ms, [{"function": f"{path.rsplit('/', 2)[-1]}:{line}:{name}", "calls": calls,
                      "own_ms": 1e3 * own, "cum_ms": 1e3 * cum} for (path, line, name), (_, calls, own, cum, _) in funcs]


# the rows' prefill paths: (name, pipelined copy, prefill graphs); "graphs" is the serial copy
# replayed (OffloadRunner prefill_graphs: its key run eagerly, then captured, in the two untimed admissions)
PATHS = {"serial": (False, False), "pipelined": (True, False), "graphs": (False, True)}


def admit_rows(runner: OffloadRunner, art: ContextArtifact, n: int, h2d_gb_per_s: float, repeats: int,
               trace_dir: Path | None = None, paths: tuple[str, ...] = ("serial", "pipelined")
               ) -> tuple[list[dict], list[tuple[str, list[tuple[str, float]]]]]:
    """The hot admission at context n by each of `paths` (PATHS): a row each, and each one's events
    (with trace_dir, each profiled admission's Chrome trace written there)."""
    from ctxcache.decoder.gpu.prefill_graph import PrefillGraphs
    runner.release(runner.admit("hot", art, QUESTION, runner.config, 64)[0])  # the load (cold), then hot ones
    rows, kernels = [], []
    for mode in paths:
        pipelined, graphs = PATHS[mode]
        runner.pipelined_prefill = pipelined
        runner.prefill_graphs = PrefillGraphs() if graphs else None
        hot_admit_ms(runner, art, 2)  # first uses of this path (graphs: eager, then captured as it runs)
        wall, moved = hot_admit_ms(runner, art, repeats)
        if graphs and runner.prefill_graphs.broken:
            raise RuntimeError("the prefill graphs' capture failed (logged): no replay to time")
        activity, events = profile_admit(runner, art, None if trace_dir is None
                                         else trace_dir / f"admit_trace_{n}_{mode}.json")
        host_ms, host_funcs = host_profile(runner, art)
        copy_ms = moved / (h2d_gb_per_s * 1e6) if h2d_gb_per_s else None
        rows.append({"context": n, "copy": mode, "admit_ms": wall, "h2d_bytes": moved,
                     "h2d_ms_at_link": copy_ms, "h2d_gb_per_s_achieved": moved / (activity["h2d_busy_ms"] * 1e6)
                     if activity["h2d_busy_ms"] else None, "link_h2d_gb_per_s": h2d_gb_per_s, **activity,
                     "host_enqueue_ms_cprofile": host_ms, "host_functions": host_funcs})
        kernels.append((mode, events))
    return rows, kernels


def resident_admit_rows(runner, art: ContextArtifact, n: int, mode: str, repeats: int
                        ) -> tuple[list[dict], list[tuple[str, list[tuple[str, float]]]]]:
    """The hot admission at context n on the fast runner (GpuRunner: the context resident in its
    slot, the question's prefill replayed as CUDA graphs), as admit_rows' rows: no host copy."""
    runner.release(runner.admit("hot", art, QUESTION, runner.config, 64)[0])  # the load (cold), then hot ones
    hot_admit_ms(runner, art, 2)  # the prefill graphs captured
    wall, _ = hot_admit_ms(runner, art, repeats)
    activity, events = profile_admit(runner, art)
    host_ms, host_funcs = host_profile(runner, art)
    path = f"resident-{mode}"
    return ([{"context": n, "copy": path, "admit_ms": wall, **activity, "host_enqueue_ms_cprofile": host_ms,
              "host_functions": host_funcs}], [(path, events)])
