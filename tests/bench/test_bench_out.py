"""Issue 29 #9: a casual benchmark run writes to a scratch folder, never over the committed
bench/results; store_io compares the loaded artifact with what was stored, like with like."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest
import torch

import ctxcache.bench as bench

ROOT = Path(__file__).resolve().parents[2]


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_default_out_is_a_scratch_folder(name, monkeypatch):
    def capture(self, args=None, namespace=None):
        raise _Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(_Parsed) as got:
        importlib.import_module(f"ctxcache.bench.{name}").main([])
    outs = {a.dest: a.default for a in got.value.parser._actions if a.dest in ("out", "results")}
    assert outs, f"{name} has no --out"
    for dest, default in outs.items():
        path = Path(default)
        assert path.is_absolute(), f"{name} --{dest} {default} depends on where it runs"
        assert not path.is_relative_to(ROOT / "bench" / "results"), f"{name} --{dest} {default}"


def test_store_io_round_trip_is_bit_exact_and_reports_the_codec_error(tmp_path, capsys, monkeypatch):
    from ctxcache.bench import store_io
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model

    art = build_artifact(load_model("random:tiny"), list(range(3, 300)),
                         make_method("csattention", {"subspaces": 2, "centroids": 4}), IndexerConfig(progress=False))
    torch.save(art, tmp_path / "art.pt")
    monkeypatch.chdir(tmp_path)
    assert store_io.main(["--artifact", str(tmp_path / "art.pt"), "--reps", "1", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "bit-exact False" not in out and "bit-exact True" in out, out
    result = json.loads(next((tmp_path / "o").glob("store_io_*.json")).read_text())
    for profile in result["profiles"].values():
        for load in profile["load"].values():
            assert load["bit_exact"] is True
            assert 0 < load["kv_max_abs_error"]["k"] < 0.1 and 0 < load["kv_max_abs_error"]["v"] < 0.1
