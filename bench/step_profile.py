"""Where a decode step's time goes: the fast runner's step (GpuRunner.step, graph replay, no
engine or gRPC) at each context length, batch and mode, broken down by kernel with
torch.profiler, beside the step's wall time and the card's copy bandwidth. Mode `offload`: the
offload runner's step (OffloadRunner, a host slot a row: V over PCIe), its PCIe bytes a step.

Why: a step that is slow for its bytes is slow either inside its kernels or between them; the
per-kernel time summed against the step says which (issue 46's H200 profile at 32K x 8: kernels
busy 10.3 of a 10.45 ms step, so the cost was inside them). Random Llama-3.1-8B weights, one
built artifact per length shared by every row (each row its own slot and tables).
`ctxcache bench step_profile [--contexts 32768] [--batches 1,8] [--modes sparse,dense,offload]
[--method-params JSON ...] [--runs N] [--out DIR]`.

`--admit [--repeats 5] [--graphs]`: instead of steps, a context's hot admission of a 20-token question at each
context and mode: resident (sparse, dense) and offloaded (the serial host copy against the pipelined one and,
`--graphs`, the serial one replayed as CUDA graphs; bench/common/admit_profile.py):
wall ms, bytes from the host, copies' and kernels' busy ms and their overlap, beside the link's
measured host -> device rate, and one admission's host functions by own time (cProfile: where a
launch-bound admission spends its host time); writes admit_profile_<device>.json."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

from ctxcache.bench.common.gpu import gpu_cli
from ctxcache.bench.common.report import print_table, write_result
from ctxcache.bench.common.admit_profile import admit_rows, resident_admit_rows
from ctxcache.bench.common.serve_limits import copy_bandwidth, h2d_gb_per_s, median_step_s
from ctxcache.bench.serve import build_times
from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.methods import make_method
from ctxcache.models.loader import load_model


def per_step(events: Iterable[tuple[str, float]], steps: int, top: int = 0) -> list[dict]:
    """(kernel name, device us) events of `steps` steps -> rows of launches and us per step,
    largest first (the first `top` where top > 0)."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in events:
        agg[name][0] += 1
        agg[name][1] += us
    rows = sorted(({"kernel": name, "launches": n / steps, "us": us / steps} for name, (n, us) in agg.items()),
                  key=lambda r: -r["us"])
    return rows[:top] if top else rows


def profile_steps(runner: GpuRunner, rows: list, steps: int = 5, repeats: int = 20) -> dict:
    """The step's median wall time and its device time (the runner's CUDA event pairs: with
    programmatic dependent launch a kernel's profiled span includes its wait, so the kernels' sum
    overstates the step), then its kernels over `steps` profiled steps."""
    from torch.profiler import ProfilerActivity, profile
    lean_before = getattr(runner, "lean_steps", 0)
    step_s = median_step_s(runner, rows, repeats)
    lean = (getattr(runner, "lean_steps", 0) - lean_before) / (repeats + 3)  # median_step_s's 3 untimed too
    device = device_times(runner, rows, lean)
    toks = [7] * len(rows)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step(rows, toks)
        torch.cuda.synchronize()
    kernels = per_step(((e.name, e.device_time_total) for e in prof.events() if e.device_type.name == "CUDA"), steps)
    return {"step_ms": 1e3 * step_s, **device, "kernels_ms": sum(k["us"] for k in kernels) / 1e3,
            "launches": sum(k["launches"] for k in kernels), "kernels": kernels}


def device_times(runner: GpuRunner, rows: list, lean: float) -> dict:
    """The step's device time (the runner's CUDA event pairs); with reselect's lean steps (a
    fraction `lean` of the steps), the full and the lean step's beside their mean."""
    if not isinstance(runner, GpuRunner):
        seconds = runner.step_seconds()
        return {"device_step_ms": None if seconds is None else 1e3 * seconds}
    kind = f"step {runner._bucket(rows)}"
    full, lean_ms = runner.times.ms(kind), runner.times.ms(f"{kind} lean")
    if not lean:
        return {"device_step_ms": full, "lean_fraction": 0.0}
    if full is None or lean_ms is None:
        return {"device_step_ms": None, "lean_fraction": lean}
    return {"device_step_ms": (1 - lean) * full + lean * lean_ms, "lean_fraction": lean, "full_step_ms": full,
            "lean_step_ms": lean_ms}


def greedy_steps(runner: OffloadRunner, rows: list, steps: int = 32) -> dict:
    """`steps` steps fed their own greedy tokens (a repeated token keeps one selection, which
    the slot caches always hit): the caches' hit rate, PCIe bytes and wall time a step."""
    tokens, times = [7] * len(rows), []
    (hits0, sel0), (bytes0, steps0) = runner.offload_hits(), runner.pcie_bytes()
    for _ in range(steps):
        start = time.perf_counter()
        tokens = runner.step(rows, tokens).argmax(-1).tolist()  # the host read waits for the step
        times.append(time.perf_counter() - start)
    (hits, sel), (moved, done) = runner.offload_hits(), runner.pcie_bytes()
    return {"greedy_hit_rate": (hits - hits0) / max(1, sel - sel0),
            "greedy_pcie_bytes_per_step": (moved - bytes0) / max(1, done - steps0),
            "greedy_step_ms": 1e3 * statistics.median(times)}


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the flag in its one-line error)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(text)


def method_params(text: str) -> dict:
    """argparse type: a JSON object of CSAttention parameters, checked by the method."""
    try:
        params = json.loads(text)
        if not isinstance(params, dict):
            raise ValueError("must be a JSON object")
        make_method("csattention", params)
    except ValueError as e:  # JSON errors and ParamError are ValueErrors
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return params


def main(argv: list[str] | None = None) -> int:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--method-params", nargs="+", type=method_params, default=[{}], metavar="JSON",
                        help="CSAttention parameters of the sparse and offload rows, one row set each (dense once): "
                             "'{}' '{\"rerank\": 3}' compares them in one run")
        ap.add_argument("--modes", default="sparse,dense",
                        help="comma-separated: sparse (csattention), dense, offload (csattention, V in host slots)")
        ap.add_argument("--top", type=int, default=12, help="kernels printed per row (the JSON keeps all)")
        ap.add_argument("--v-cache", default="8", type=lambda x: [float(v) for v in x.split(",") if v],
                        help="mode offload: each slot cache's V rows in selections (OffloadRunner v_cache), comma-separated")
        ap.add_argument("--offload-waves", default="2", type=lambda x: [int(v) for v in x.split(",") if v],
                        help="mode offload: the decode attention's programs per SM (OffloadRunner attention_waves; "
                             "its PCIe reads run in series within a program), comma-separated")
        ap.add_argument("--offload-v", default="int8", choices=["int8", "bf16"],
                        help="mode offload and --admit: host slots hold V as the artifact's int8 codes (OffloadRunner "
                             "v_int8, as serve with --kv-codec int8) or decoded to bf16 (before)")
        ap.add_argument("--admit", action="store_true",
                        help="profile a hot admission (20-token question) per context and mode instead of decode "
                             "steps: resident (sparse, dense), offloaded (serial vs pipelined host copy)")
        ap.add_argument("--repeats", type=int, default=5, help="--admit: timed admissions per row (median)")
        ap.add_argument("--runs", type=positive_int, default=1,
                        help="runners built and profiled per row, the median device step's kept (each run's "
                             "device step beside it): one runner's allocation moves the step up to ~4%%")
        ap.add_argument("--graphs", action="store_true",
                        help="--admit: also the serial admission replayed as CUDA graphs (OffloadRunner "
                             "prefill_graphs, serve --offload-prefill-graphs), captured on its key's second use, "
                             "then timed")
        ap.add_argument("--stagger", action="store_true",
                        help="step the odd rows once more before timing: their reselect countdowns then differ from "
                             "the even rows' (every step mixes carried and selecting rows, none is lean; the engine "
                             "holds rows to avoid this in a server)")
        ap.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch (CTXCACHE_NO_PDL=1): each kernel's time "
                             "its own, not overlapping its wait for the one before")
        ap.add_argument("--trace", action="store_true", help="--admit: also write each profiled admission's "
                        "timeline (host CUDA calls and both streams) as a Chrome trace beside the JSON")
    args = gpu_cli("ctxcache bench step_profile", "32768", argv, extra, __doc__)
    if args is None:
        return 2
    modes = args.modes.split(",")
    if any(m not in ("sparse", "dense", "offload") for m in modes):
        print(f"ctxcache bench step_profile: error: --modes {args.modes!r}: sparse, dense or offload", flush=True)
        return 2
    if args.no_pdl:
        os.environ["CTXCACHE_NO_PDL"] = "1"  # read as each runner's selector is made
    lm = load_model("random:llama-3.1-8b", torch.bfloat16, "cuda")
    config = SparseConfig.from_schedule("0.05-step-1")
    if args.admit:
        return admissions(lm, make_method("csattention", args.method_params[0]).params, config, args)
    rows_out, top = [], []
    runs = [(m, vc, w) for m in modes for vc in (args.v_cache if m == "offload" else [None])
            for w in (args.offload_waves if m == "offload" else [None])]
    for n, (nth, mp) in itertools.product(args.contexts, enumerate(args.method_params)):
        _, art = build_times(lm, n, mp)
        sparse = make_method("csattention", mp).params
        params = {"sparse": sparse, "dense": None, "offload": sparse}
        for mode, v_cache, waves in runs:
            for b in args.batches if mode != "dense" or nth == 0 else ():  # dense rows once a context
                made = [one_run(lm, art, config, mode, params[mode], b, n, v_cache, waves, args)
                        for _ in range(args.runs)]
                got = sorted(made, key=lambda r: r.get("device_step_ms") or 0.0)[len(made) // 2]
                if args.runs > 1:
                    got["device_step_ms_runs"] = [r.get("device_step_ms") for r in made]
                rows_out.append({"context": n, "mode": mode, "batch": b, "pdl": not args.no_pdl, "stagger": args.stagger,
                                 "method_params": json.dumps(mp) if mode != "dense" else None,
                                 "v_cache": v_cache, "offload_waves": waves,
                                 "offload_v": args.offload_v if mode == "offload" else None, **got})
                top += [{"context": n, "mode": mode, "batch": b, "method_params": rows_out[-1]["method_params"], **k}
                        for k in got["kernels"][:args.top]]
        del art
    path = write_result("step_profile", {"copy_gb_per_s": copy_bandwidth("cuda") / 1e9, "rows": rows_out}, args.out)
    print_table(top, ["context", "mode", "batch", "method_params", "kernel", "launches", "us"])
    print_table(rows_out, ["context", "mode", "batch", "method_params", "v_cache", "offload_waves", "offload_splits",
                           "step_ms", "device_step_ms", "device_step_ms_runs", "lean_fraction", "full_step_ms",
                           "lean_step_ms", "kernels_ms",
                           "launches", "pcie_bytes_per_step",
                           "greedy_hit_rate", "greedy_pcie_bytes_per_step", "greedy_step_ms"])
    print(f"wrote {path}")
    return 0


def one_run(lm, art, config: SparseConfig, mode: str, params, b: int, n: int, v_cache, waves,
            args: argparse.Namespace) -> dict:
    """A fresh runner of `b` rows on the context, its step profiled (profile_steps; offload: its
    greedy steps and PCIe bytes too); the runner is freed after."""
    runner = (OffloadRunner(lm, params, config, slots=b, max_len=n + 512, v_cache=v_cache,
                            v_int8=args.offload_v == "int8", attention_waves=waves) if mode == "offload"
              else GpuRunner(lm, params, config, b, n + 512))
    rows = [runner.admit(f"c{i}", art, [5 + i] * 20, config, 96)[0] for i in range(b)]
    greedy = greedy_steps(runner, rows) if mode == "offload" else {}
    runner.step(rows, [7] * b)  # the bucket's graph captured first (its warm-up runs count too)
    if args.stagger and b > 1:
        runner.step(rows[1::2], [7] * len(rows[1::2]))
    before = runner.pcie_bytes() if mode == "offload" else None
    got = {**greedy, **profile_steps(runner, rows)}
    if before is not None:  # over the timed and profiled steps
        moved, steps = (now - was for now, was in zip(runner.pcie_bytes(), before))
        got["pcie_bytes_per_step"] = moved / steps if steps else None
    if mode == "offload":
        got["offload_splits"] = runner.attention_splits(b)
    del runner, rows
    torch.cuda.empty_cache()
    return got


def admissions(lm, sparse, config: SparseConfig, args: argparse.Namespace) -> int:
    """--admit: each context's hot admission in each mode (offload: serial and pipelined copy), profiled."""
    link = h2d_gb_per_s() if "offload" in args.modes.split(",") else None
    rows_out, top, host = [], [], []
    for n, mode in itertools.product(args.contexts, args.modes.split(",")):
        _, art = build_times(lm, n, {})
        if mode == "offload":
            runner = OffloadRunner(lm, sparse, config, slots=1, max_len=n + 512, v_int8=args.offload_v == "int8")
            paths = ("serial", "pipelined") + (("graphs",) if args.graphs else ())
            rows, events = admit_rows(runner, art, n, link, args.repeats, Path(args.out) if args.trace else None,
                                      paths)
        else:
            runner = GpuRunner(lm, sparse if mode == "sparse" else None, config, 1, n + 512)
            rows, events = resident_admit_rows(runner, art, n, mode, args.repeats)
        rows_out += rows
        for row, (path, ev) in zip(rows, events):
            kernels = per_step(ev, 1)
            row["kernels"] = kernels
            top += [{"context": n, "copy": path, **k} for k in kernels[:args.top]]
            host += [{"context": n, "copy": path, **f} for f in row["host_functions"][:args.top]]
        del runner, art
        torch.cuda.empty_cache()
    path = write_result("admit_profile", {"h2d_gb_per_s": link, "rows": rows_out}, args.out)
    print_table(top, ["context", "copy", "kernel", "launches", "us"])
    print_table(host, ["context", "copy", "function", "calls", "own_ms", "cum_ms"])
    print_table(rows_out, ["context", "copy", "admit_ms", "h2d_bytes", "h2d_ms_at_link", "link_h2d_gb_per_s",
                           "h2d_busy_ms", "h2d_gb_per_s_achieved", "kernels_busy_ms", "overlap_ms", "device_span_ms",
                           "host_enqueue_ms_cprofile", "copy_streams", "kernel_streams"])
    print(f"wrote {path}")
    return 0
