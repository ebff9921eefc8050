"""`ctxcache bench`: every benchmark listed and reachable, each with --help; bench-only helpers on CPU."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest
import torch

import ctxcache.bench as bench
from ctxcache.bench.common.report import device_tag, write_result
from ctxcache.service.cli.main import main as cli_main


def test_bench_help_lists_every_benchmark_and_nothing_else():
    out = subprocess.run([sys.executable, "-c", "from ctxcache.service.cli.main import main; main(['bench', '--help'])"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in bench.BENCHMARKS:
        assert f"\n  {name} " in out.stdout
    modules = {m.name for m in pkgutil.iter_modules(bench.__path__) if not m.ispkg}
    assert modules == set(bench.BENCHMARKS)  # each bench/*.py is a benchmark the list names


@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_each_benchmark_has_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", name, "--help"])
    assert exc.value.code == 0
    assert f"ctxcache bench {name}" in capsys.readouterr().out


def test_unknown_benchmark_is_one_line_not_a_traceback(capsys):
    assert cli_main(["bench", "step_probe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown benchmark 'step_probe'" in err and "attention" in err


def test_result_file_is_named_for_bench_and_device_with_commit_and_date(tmp_path):
    path = write_result("demo", {"rows": [1]}, tmp_path)
    assert path == tmp_path / f"demo_{device_tag()}.json"
    import json
    got = json.loads(path.read_text())
    assert got["bench"] == "demo" and got["rows"] == [1] and len(got["date"]) == 10
    assert "commit" in got and "cpu_count" in got["machine"]


def test_device_tag():
    assert device_tag({"gpu": None}) == "cpu"
    assert device_tag({"gpu": {"name": "NVIDIA H100 80GB HBM3"}}) == "h100"
    assert device_tag({"gpu": {"name": "NVIDIA H200"}}) == "h200"


@pytest.mark.parametrize("shared", [False, True])
def test_decode_tables_are_per_row_unless_shared(shared):
    from ctxcache.bench.decode import dense_layer_tables
    from ctxcache.methods.csattention import CSAttentionParams
    params = CSAttentionParams(table_dtype="int8")
    tabs = dense_layer_tables(3, 64, 5, params, steps=4, shared=shared, buffers=2, device="cpu")
    assert len(tabs) == 5 and tabs[0].dense_score.shape[0] == 3
    assert (tabs[0].dense_score.stride(0) == 0) == shared
    assert tabs[0].dense_score.data_ptr() == tabs[2].dense_score.data_ptr() != tabs[1].dense_score.data_ptr()
    assert tabs[0].new_scores.data_ptr() != tabs[2].new_scores.data_ptr()  # each layer streams its own keys
    assert tabs[0].new_scores.shape[-1] == 4 + 8
    if not shared:
        assert not torch.equal(tabs[0].dense_score[0], tabs[0].dense_score[1])


def test_decode_rotates_as_many_table_buffers_as_fit():
    from ctxcache.bench.decode import DENSE_BUFFERS, RESERVE, dense_buffers
    from ctxcache.bench.common.gpu import dense_table_bytes
    from ctxcache.methods.csattention import CSAttentionParams
    p = CSAttentionParams(table_dtype="int8")
    one = dense_table_bytes(8, 131072, p, "int8")
    assert dense_buffers(8, 131072, 32, p, False, RESERVE + 10 * one) == DENSE_BUFFERS
    assert dense_buffers(8, 131072, 2, p, False, RESERVE + 10 * one) == 2
    assert dense_buffers(8, 131072, 32, p, False, RESERVE + 1.5 * one) == 1
    assert dense_buffers(8, 131072, 32, p, False, RESERVE) == 0
    assert dense_buffers(8, 131072, 32, p, True, RESERVE + one) == DENSE_BUFFERS  # one row's tables


def test_plot_lines_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from ctxcache.bench.common.report import plot_lines
    path = plot_lines(tmp_path / "p.png", {"batch 1": [(8192, 1.5), (131072, 5.3)]}, "context", "x SDPA", "t")
    assert path is not None and path.stat().st_size > 0
