"""`bench service`'s llama.cpp line (bench/service.py, measure_llama_cpp): a number through llama-bench's
JSON where a binary is installed, a line saying what is missing where nothing is."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from ctxcache.bench import service as llama_cpp


@pytest.fixture
def no_python_binding(monkeypatch):
    import builtins
    real = builtins.__import__

    def refuse(name, *args, **kw):
        if name == "llama_cpp":
            raise ImportError("no llama_cpp here")
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", refuse)


def test_nothing_installed_says_so(no_python_binding, monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    got = llama_cpp.measure_llama_cpp(tmp_path / "m.gguf", 4000, 32, 2)
    assert got.tokens_per_s is None
    assert got.line().startswith("llama.cpp: not measured (neither llama-cpp-python nor a llama-bench binary")


def _fake_bench(tmp_path: Path, stdout: str) -> Path:
    """A llama-bench stand-in that records its arguments and prints `stdout`."""
    script = tmp_path / "llama-bench"
    (tmp_path / "out.json").write_text(stdout)
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncat {tmp_path}/out.json\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_llama_bench_json_is_read(no_python_binding, monkeypatch, tmp_path):
    rows = [{"n_prompt": 0, "n_gen": 32, "n_depth": 4000, "avg_ts": 61.5}]
    monkeypatch.setenv("LLAMA_BENCH", str(_fake_bench(tmp_path, json.dumps(rows))))
    got = llama_cpp.measure_llama_cpp(tmp_path / "m.gguf", 4000, 32, 2)
    assert got.tokens_per_s == 61.5 and got.line() == "61.5 tok/s (llama-bench, depth 4000)"
    assert (tmp_path / "args").read_text().split()[:8] == ["-m", str(tmp_path / "m.gguf"), "-p", "0", "-n", "32",
                                                           "-d", "4000"]


def test_a_failing_llama_bench_is_one_line(no_python_binding, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_BENCH", str(_fake_bench(tmp_path, "error: unknown argument: -d")))
    got = llama_cpp.measure_llama_cpp(tmp_path / "m.gguf", 4000, 32, 2)
    assert got.tokens_per_s is None and "failed" in got.line() and "\n" not in got.line()
