"""auto's table (decoder/decode_mode.py) against the benchmark results it cites: on the CPU
dense decodes faster at every context length measured; on the GPU sparse wins wherever the
served runner holds 8 streams or 124K tokens (the one GPU mode a server picks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxcache.decoder.decode_mode import CROSSOVERS, decode_path, describe, resolve

REPO = Path(__file__).resolve().parents[2]


def _faster(rows: list[dict], key) -> dict:
    """{row key: the faster mode's name} from rows with mode and aggregate_tokens_per_s."""
    best: dict = {}
    for r in rows:
        k = key(r)
        if k not in best or r["aggregate_tokens_per_s"] > best[k][1]:
            best[k] = (r["mode"], r["aggregate_tokens_per_s"])
    return {k: v[0] for k, v in best.items()}


def test_cpu_entry_matches_its_benchmark() -> None:
    entry = CROSSOVERS["cpu"]
    rows = json.loads((REPO / entry.measured[0]).read_text())["rows"]
    faster = _faster(rows, lambda r: r["context_tokens"])
    assert len(faster) >= 2  # more than one context length measured
    for tokens, mode in faster.items():
        assert mode == resolve("auto", "cpu", tokens), (tokens, mode)


def test_gpu_entry_matches_serve_rows() -> None:
    entry = CROSSOVERS["cuda"]
    for name in entry.measured:
        rows = json.loads((REPO / name).read_text())["rows"]
        faster = _faster([{**r, "mode": "sparse" if r["mode"] == "csattention" else r["mode"]} for r in rows],
                         lambda r: (r["context"], r["streams"]))
        served = {k: m for k, m in faster.items() if k[1] >= 8 or k[0] >= 100_000}
        assert served and all(m == "sparse" for m in served.values()), (name, faster)
        assert all(m == resolve("auto", "cuda", k[0]) for k, m in served.items())


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
def test_explicit_modes_pass_through(device: str) -> None:
    assert resolve("sparse", device, 100) == "sparse" and resolve("dense", device, 1 << 20) == "dense"


def test_auto_picks_and_says_so() -> None:
    assert resolve("auto", "cpu", 4096) == "dense" and resolve("auto", "cuda", 32768) == "sparse"
    assert resolve("auto", "mps", 10) == "sparse"  # no entry: the mode every method serves
    assert describe("auto", "cpu") == "auto: dense at every context length (cpu)"
    assert describe("dense", "cuda") == "dense"
    assert decode_path("reference", True) == "reference-dense" and decode_path("gpu-dense", True) == "gpu-dense"
    with pytest.raises(ValueError, match="'fast'"):
        resolve("fast", "cpu", 1)
