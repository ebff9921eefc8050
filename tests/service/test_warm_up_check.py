"""Issue 43 item 7: a GPU server's warm-up runs first in a child process, so a compiler abort
during warm-up ends the start with one line (signal, kernel) and exit 1, not a native backtrace.
On this CPU box the child is real but has nothing to compile: the test hook (an env var the
child alone reads) makes it abort or exit, and `on_gpu` is forced where the server must check."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import triton
from triton.runtime.jit import JitFunctionInfo

from ctxcache.kernels.compiles import report_compiles
from ctxcache.service import warm_up_check
from ctxcache.service.cli import main as cli
from ctxcache.service.cli.commands import service_config
from ctxcache.service.server import create_server

from service_helpers import tiny_config

SERVE = ["serve", "--model", "random:tiny", "--port", "0"]


@pytest.fixture
def gpu_like(monkeypatch):
    """The server believes it runs on a GPU; the child, on a CPU config, warms nothing up."""
    monkeypatch.setattr(warm_up_check, "on_gpu", lambda config: True)


@pytest.mark.parametrize("fault, words", [("abort", "aborted (signal 6, SIGABRT)"),
                                          ("exit:3", "exited with status 3")])
def test_a_child_that_dies_ends_the_start_in_one_line(fault, words, gpu_like, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv(warm_up_check.FAULT_ENV, fault)
    rc = cli.main([*SERVE, "--data", str(tmp_path / "s"), "--warm-up-check"])
    err = capfd.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("ctxcache: error: warm-up failed: ") and words in err, err
    assert "before compiling any kernel" in err and "did not start" in err, err
    log = Path(re.search(r"child's output: (\S+)", err)[1])
    assert log.exists()  # kept for the operator: the child's own lines (an abort's stack)
    if fault == "abort":
        assert "Fatal Python error: Aborted" in log.read_text(), log.read_text()
    shutil.rmtree(log.parent)
    assert not (tmp_path / "s").exists()  # it failed before the server opened anything


def test_a_normal_child_returns_and_the_server_starts(gpu_like, tmp_path, caplog):
    caplog.set_level(logging.INFO, "ctxcache.service")
    cfg = tiny_config(tmp_path / "data")
    server, port = create_server(dataclasses.replace(cfg, decoder=dataclasses.replace(cfg.decoder, warm_up_check=True)))
    try:
        assert port > 0 and server.ready.is_set()
    finally:
        server.stop(0)
    checked = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up check:")]
    assert len(checked) == 1 and re.search(r"warmed up in \d+\.\d s \(0 kernel compilations\)", checked[0]), checked


def test_with_no_warm_up_check_no_child_runs(gpu_like, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(warm_up_check.FAULT_ENV, "abort")  # a child would die: none runs
    caplog.set_level(logging.INFO, "ctxcache.service")
    args = cli.build_parser().parse_args([*SERVE, "--data", str(tmp_path / "s"), "--no-warm-up-check"])
    server, port = create_server(service_config(args, 0))
    server.stop(0)
    assert port > 0 and not any("warm-up check" in r.getMessage() for r in caplog.records)


def test_only_a_gpu_server_that_decodes_checks(tmp_path):
    cpu = tiny_config(tmp_path)
    cpu = dataclasses.replace(cpu, decoder=dataclasses.replace(cpu.decoder, warm_up_check=True))
    gpu = dataclasses.replace(cpu, model=dataclasses.replace(cpu.model, device="cuda"))
    assert warm_up_check.needed(gpu)
    assert not warm_up_check.needed(cpu)  # a CPU interprets its kernels: nothing compiles
    assert not warm_up_check.needed(dataclasses.replace(gpu, decoder=dataclasses.replace(
        gpu.decoder, warm_up_check=False)))
    indexer = dataclasses.replace(gpu, fleet=dataclasses.replace(gpu.fleet, role="indexer"),
                                  registry=dataclasses.replace(gpu.registry, redis_url="redis://r:6379/0"),
                                  store=dataclasses.replace(gpu.store, object_store_uri="file:///o"))
    assert not warm_up_check.needed(indexer)  # an indexer decodes nothing
    args = cli.build_parser().parse_args([*SERVE, "--device", "cuda"])
    assert service_config(args, 0).decoder.warm_up_check  # on by default
    args = cli.build_parser().parse_args([*SERVE, "--device", "cuda", "--no-warm-up-check"])
    assert not service_config(args, 0).decoder.warm_up_check


def test_the_line_names_the_kernel_the_compiler_died_in(monkeypatch, tmp_path):
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "jit_cache_hook", None)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)
    lines: list[str] = []
    report_compiles(lines.append)
    out = tmp_path / "child.log"
    for name in ("_rope_write", "_score_kernel"):  # Triton calls the hooks as jit.py's _call_hook does
        info = JitFunctionInfo(sys.modules[__name__], name, None)
        assert not runtime.jit_cache_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                                          already_compiled=False)
        if name == "_rope_write":
            runtime.jit_post_compile_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                                          already_compiled=False)
    assert lines == ["start _rope_write", "done _rope_write", "start _score_kernel"]
    assert ("the GPU kernel compiler aborted (signal 6, SIGABRT) while compiling _score_kernel; a Triton/LLVM bug"
            in warm_up_check.failure_line(-6, lines, out))
    killed = warm_up_check.failure_line(-9, lines, out)  # sent from outside (the OOM killer): no compiler bug
    assert "child process died (signal 9, SIGKILL) while compiling _score_kernel." in killed, killed
    done = warm_up_check.failure_line(-11, lines[:2], out)
    assert "died (signal 11, SIGSEGV) after compiling _rope_write (its last kernel)" in done, done
    assert warm_up_check.failure_line(1, [*lines, "error no such file: /m"], out) == "no such file: /m"


def test_a_child_whose_server_is_gone_stops(tmp_path):
    """A server SIGKILLed while its child warms up: the child stops instead of holding the GPU."""
    gone = subprocess.Popen(["true"])  # a pid that is not the child's parent
    gone.wait()
    child = subprocess.run([sys.executable, "-m", "ctxcache.service.warm_up_check", str(tmp_path / "progress"),
                            str(gone.pid)], input=pickle.dumps(tiny_config(tmp_path / "s")), capture_output=True,
                           env={**os.environ, warm_up_check.FAULT_ENV: "abort"}, timeout=60)
    assert child.returncode == 70, child.stderr[-2000:]  # not -6: it stopped before its warm-up's end
    assert not (tmp_path / "progress").exists()


@pytest.mark.gpu
def test_a_real_server_whose_compiler_aborts_says_one_line(tmp_path):
    """`ctxcache serve` on the GPU, its child aborting at the first kernel it compiles: exit 1,
    one line naming SIGABRT and that kernel (a fresh Triton cache, so every compile is real)."""
    env = {**os.environ, warm_up_check.FAULT_ENV: "abort", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run([sys.executable, "-m", "ctxcache.service", *SERVE, "--device", "cuda", "--warm-up-check",
                           "--data", str(tmp_path / "s")], env=env, capture_output=True, text=True, timeout=600)
    err = done.stderr.strip()
    assert done.returncode == 1, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"the GPU kernel compiler aborted \(signal 6, SIGABRT\) while compiling \w+;", err), err


@pytest.mark.gpu
def test_a_real_gpu_server_checks_then_serves(tmp_path):
    """A GPU start with the check: the child compiles every kernel (logged with its time), then the
    server warms up on the cache it filled and serves."""
    log = tmp_path / "serve.log"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ctxcache.service", "-v", *SERVE, "--device", "cuda",
                                 "--warm-up-check", "--data", str(tmp_path / "s")], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "ctxcache serving on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log.read_text()
        assert "ctxcache serving on" in text, text[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    checked = re.search(r"warm-up check: .* warmed up in (\d+\.\d) s \((\d+) kernel compilations\)", text)
    assert checked and int(checked[2]) > 0, text[-3000:]
    print(checked[0], re.search(r"warm-up: .*", text)[0], sep="\n")  # the child's and the server's, for the record
