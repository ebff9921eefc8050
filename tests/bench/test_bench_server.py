"""`bench service` and `bench serve` end to end on the CPU with the tiny random model: each starts
a `ctxcache serve` process, waits for its health and reads it through the gRPC API alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxcache.client.server_process import running_server

TINY = ["--model", "random:tiny", "--repeats", "1"]


def _result(folder: Path, bench: str) -> dict:
    (path,) = folder.glob(f"{bench}_*.json")
    return json.loads(path.read_text())


def test_bench_service_reads_parts_and_batches_from_the_api(tmp_path):
    from ctxcache.bench import service
    assert service.main([*TINY, "--method", "key-kmeans", "--tokens", "300", "--max-tokens", "4",
                         "--out", str(tmp_path)]) == 0
    got = _result(tmp_path, "service")
    assert got["context_tokens"] > 250 and got["model"].startswith("random:tiny")
    assert sum(got["stored_bytes_by_part"].values()) == got["artifact_bytes"] > 0
    assert got["cold_ttft_s"] > 0 and got["reprefill_ttft_s"] > 0
    assert [t["streams"] for t in got["throughput"]] == [1, 4, 16]
    assert all(not t["errors"] and t["tokens"] > 0 for t in got["throughput"])
    assert got["throughput"][0]["mean_decode_batch"] == 1.0  # one stream: batches of one
    assert got["llama_cpp"] == {"tokens_per_s": None, "via": "only for the bundled smollm2 GGUF, not random:tiny"}


def test_bench_serve_measures_every_tier_in_every_mode_on_one_store(tmp_path):
    from ctxcache.bench import serve
    assert serve.main([*TINY, "--contexts", "300", "--streams", "1,2", "--tokens", "4", "--modes", "sparse,offload,dense",
                       "--out", str(tmp_path)]) == 0
    got = _result(tmp_path, "serve")
    assert [(r["mode"], r["streams"]) for r in got["rows"]] == [
        ("csattention", 1), ("csattention", 2), ("csattention-offload", 1), ("csattention-offload", 2),
        ("dense", 1), ("dense", 2)]
    rate = {(r["mode"], r["streams"]): r["aggregate_tokens_per_s"] for r in got["rows"]}
    assert [(o["streams"], o["agg_offloaded_over_resident"]) for o in got["offload"]] == [
        (s, rate["csattention-offload", s] / rate["csattention", s]) for s in (1, 2)]
    assert all(o["contexts_over_resident_slots"] is None for o in got["offload"])  # a CPU: no HBM bound
    for row in got["rows"]:
        assert set(row["ttft_p50_s"]) == {"hot", "warm", "cold", "reprefill"} and row["aggregate_tokens_per_s"] > 0
        assert row["itl_mean_ms"] > 0  # the served decode step, TTFT excluded
    (build,) = got["build"]
    assert build["context"] == 300 and build["put_seconds"] > 0 and build["prefill_seconds"] > 0


def test_a_server_that_cannot_start_is_one_error_with_its_reason(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 2 before serving.*invalid choice"):
        with running_server(["--decode-mode", "bogus"], tmp_path / "serve.log"):
            pass


def test_bench_serve_reports_pcie_bytes_per_step_over_the_measured_runs():
    """Stats before and after the measured runs: the offload runner's bytes over their steps,
    and the time the measured host -> device rate gives them."""
    from types import SimpleNamespace

    from ctxcache.bench.serve import pcie_of
    before = SimpleNamespace(offload_steps=10, offload_pcie_bytes=5_000_000)
    now = SimpleNamespace(offload_steps=110, offload_pcie_bytes=5_000_000 + 100 * 40_000_000)
    got = pcie_of(before, now, 50.0)
    assert got["pcie_bytes_per_step"] == 40_000_000 and got["offload_steps"] == 100
    assert abs(got["pcie_ms_per_step_at_h2d"] - 0.8) < 1e-9 and got["h2d_gb_per_s"] == 50.0
    assert pcie_of(now, now, None)["pcie_bytes_per_step"] is None


def test_bench_serve_reports_offloaded_contexts_over_the_resident_slots():
    """Each offloaded row's streams (contexts decoded at once) over the resident slots the card's
    free HBM holds, beside the aggregate over the resident row of the same run."""
    from ctxcache.bench.common.serve_report import offload_over_resident
    rows = [{"context": 32768, "streams": s, "mode": mode, "index": "16x16", "commit": "c", "aggregate_tokens_per_s": agg,
             **({"resident_slots_fit": 19, "offload_k": "hbm"} if mode == "csattention-offload" else {})}
            for s, mode, agg in ((8, "csattention", 700.0), (8, "csattention-offload", 350.0),
                                 (19, "csattention", 900.0), (23, "csattention-offload", 400.0))]
    got = offload_over_resident(rows)
    assert [(o["streams"], o["agg_offloaded_over_resident"], o["contexts_over_resident_slots"]) for o in got] == [
        (8, 0.5, 8 / 19), (23, None, 23 / 19)]  # no resident row of 23 streams to divide by
