"""bench serve's result: rows kept from earlier runs of other lengths, the capacity and offload
ratios within one run, the JSON, the plot and the printed tables."""

from __future__ import annotations

import json
from pathlib import Path

from ctxcache.bench.common.report import device_tag, machine_info, print_table, write_result

# the rows' name of each --modes entry
ROW_NAME = {"sparse": "csattention", "offload": "csattention-offload", "dense": "dense"}


def report(args, rows: list[dict], builds: list[dict], measured: set[tuple[int, str]]) -> Path:
    """Write and print this run's rows (stamped with commit and date) beside the earlier result's
    rows of lengths and indexes it did not measure (`measured`: (context, index)); -> the JSON's path."""
    info = machine_info()
    rows, builds = keep_other_lengths(Path(args.out) / f"serve_{device_tag(info)}.json", args, measured, rows, builds)
    capacity, offload = best_per_mode(rows), offload_over_resident(rows)
    out = write_result("serve", {"device": (info.get("gpu") or {}).get("name") or info["cpu"], "model": args.model,
                                 "dtype": args.dtype, "tokens_per_stream": args.tokens, "rows": rows,
                                 "build": builds, "capacity": capacity, "offload": offload}, args.out)
    plot(rows, out.with_suffix(".png"))
    print_table([{**r, **{f"ttft_{k}": v for k, v in r["ttft_p50_s"].items()}} for r in rows],
                ["context", "streams", "mode", "aggregate_tokens_per_s", "per_stream_tokens_per_s",
                 "ttft_hot", "ttft_warm", "ttft_cold", "ttft_reprefill"])
    print_table(rows, ["context", "streams", "mode", "runner_step_ms", "served_step_ms", "served_of_runner",
                       "floor_ms", "floor_fraction", "itl_mean_ms", "itl_p50_ms", "itl_p99_ms"])
    if offload:
        print_table(offload, ["context", "streams", "offload_k", "agg_offloaded_over_resident", "resident_slots_fit",
                              "contexts_over_resident_slots"])
        print_table([r for r in rows if "pcie_bytes_per_step" in r],
                    ["context", "streams", "mode", "offload_k", "pcie_bytes_per_step", "h2d_gb_per_s",
                     "pcie_ms_per_step_at_h2d", "served_step_ms", "offload_hit_rate"])
    print_table([{"context": r["context"], "mode": r["mode"], **r["admission"]} for r in rows if "admission" in r],
                ["context", "mode", "joiner_ttft_p50_ms", "joiner_ttft_p99_ms", "others_itl_p50_ms",
                 "others_itl_p99_during_ms", "others_itl_p99_during_over_p50", "runner_prefill_ms"])
    print_table(builds, ["context", "prefill_seconds", "index_seconds", "put_seconds"])
    print_table(capacity, ["context", "hbm_gib", "index", "mode", "slots", "slot_gib", "best_streams", "best_aggregate_tokens_per_s",
                           "over_dense"])
    print(f"wrote {out}")
    return out


def offload_over_resident(rows: list[dict]) -> list[dict]:
    """Per length, stream count and index: the offloaded aggregate tok/s over the resident sparse
    one, both rows of this run (rows kept from earlier runs carry another commit; None where the
    run has no resident row of as many streams), and the offloaded contexts decoded at once over
    the resident slots the card's free HBM holds."""
    key = lambda r: (r["context"], r["streams"], r.get("index"), r.get("commit"))  # noqa: E731
    resident = {key(r): r["aggregate_tokens_per_s"] for r in rows if r["mode"] == ROW_NAME["sparse"]}
    return [{"context": r["context"], "streams": r["streams"], "index": r.get("index"), "offload_k": r.get("offload_k"),
             "agg_offloaded_over_resident": (r["aggregate_tokens_per_s"] / resident[key(r)]
                                             if resident.get(key(r)) else None),
             "resident_slots_fit": r.get("resident_slots_fit"),
             "contexts_over_resident_slots": r["streams"] / r["resident_slots_fit"] if r.get("resident_slots_fit") else None}
            for r in rows if r["mode"] == ROW_NAME["offload"]]


def best_per_mode(rows: list[dict]) -> list[dict]:
    """Per context length, HBM budget, server method parameters and mode: the stream count with the
    highest aggregate tok/s, and that rate over dense's best in the same run (same length, budget
    and parameters)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["context"], r.get("hbm_gib", 0), r.get("index"), r["mode"])
        if key not in best or r["aggregate_tokens_per_s"] > best[key]["best_aggregate_tokens_per_s"]:
            best[key] = {"context": r["context"], "hbm_gib": r.get("hbm_gib", 0), "mode": r["mode"],
                         "slots": r.get("slots"), "slot_gib": r.get("slot_gib"), "best_streams": r["streams"],
                         "best_aggregate_tokens_per_s": r["aggregate_tokens_per_s"],
                         "method_params": r.get("method_params", "{}"), "index": r.get("index"),
                         "commit": r.get("commit")}
    for b in best.values():
        dense = best.get((b["context"], b["hbm_gib"], b["index"], "dense"))
        b["over_dense"] = b["best_aggregate_tokens_per_s"] / dense["best_aggregate_tokens_per_s"] if dense else None
    return sorted(best.values(), key=lambda b: (b["context"], b["hbm_gib"], b["index"] or "", b["mode"]))


def keep_other_lengths(path: Path, args, measured: set[tuple[int, str]], rows: list[dict],
                       builds: list[dict]) -> tuple[list[dict], list[dict]]:
    """Rows of the earlier result for context lengths (or server method parameters) this run did
    not measure, when that run used the same model, dtype and tokens per stream (a long length
    needs a call of its own on the GPU machine). Every row names the commit and date of its run;
    ratios between modes are always within one run."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return rows, builds
    if (old.get("model"), old.get("dtype"), old.get("tokens_per_stream")) != (args.model, args.dtype, args.tokens):
        return rows, builds
    stamp = {"commit": old.get("commit"), "date": old.get("date")}
    other = lambda r: (r["context"], r.get("index")) not in measured  # noqa: E731
    kept = [{**stamp, **r} for r in old.get("rows", []) if other(r)]
    kept_builds = [{**stamp, **b} for b in old.get("build", []) if other(b)]
    by_length = lambda r: (r["context"], r.get("index", ""), r.get("mode", ""), r.get("streams", 0))  # noqa: E731
    return sorted(kept + rows, key=by_length), sorted(kept_builds + builds, key=by_length)


def plot(rows: list[dict], path: Path) -> None:
    """Aggregate tok/s against concurrent streams, one line per context and mode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    line = lambda r: (r["context"], r.get("index") or "", r["mode"])  # noqa: E731
    for key in sorted({line(r) for r in rows}):
        pts = sorted((r["streams"], r["aggregate_tokens_per_s"]) for r in rows if line(r) == key)
        params = f" {key[1]}" if key[1] else ""
        ax.plot(*zip(*pts), marker="o", linestyle="-" if key[2] == "csattention" else "--",
                label=f"{key[0] // 1024}K {key[2]}{params}")
    ax.set(xlabel="concurrent streams (distinct contexts)", ylabel="aggregate generated tok/s",
           title="ctxcache serve through gRPC")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
