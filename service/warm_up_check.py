"""A GPU server's warm-up runs first in a short-lived child process, so that a crash inside
Triton's compiler (LLVM has aborted twice: "Cannot select: v2f16 = scalar_to_vector") ends
the start with one line naming the signal and the kernel, not with the server's death by
SIGABRT and a native backtrace. The child builds the same model and runners, warms up (every
kernel then sits in Triton's on-disk cache, which both processes share) and exits; the server
then warms up in-process on cache hits. The server stays the process its caller started (the
fault tests signal that pid), and the child has exited, its GPU memory freed, before the
server loads anything. A fresh interpreter, not a fork: CUDA does not survive fork."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ctxcache.service.config import ServiceConfig

log = logging.getLogger("ctxcache.service")
# tests only, read by the child alone: "abort" or "exit:N" at the first kernel the child starts
# compiling (or, where it compiles none: a CPU, at the end of its warm-up)
FAULT_ENV = "CTXCACHE_WARM_UP_CHECK_FAULT"
_CRASHES = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
_TAIL = 20  # the child's last output lines the server logs when it failed


class WarmUpCheckFailed(RuntimeError):
    """The warm-up child died or failed: the server must not start (the message is one line)."""


def on_gpu(config: ServiceConfig) -> bool:
    return config.model.device.startswith("cuda")


def needed(config: ServiceConfig) -> bool:
    """On a GPU only (a CPU interprets its kernels: nothing compiles), where runners warm up (an
    indexer decodes nothing) and the config asks (--warm-up-check)."""
    return config.decoder.warm_up_check and config.fleet.role != "indexer" and on_gpu(config)


def check_warm_up(config: ServiceConfig) -> None:
    """Where needed: run the warm-up in a child and wait for it; raises WarmUpCheckFailed naming
    how it ended. Call before this process allocates on the GPU (the child needs the memory)."""
    if not needed(config):
        return
    folder = Path(tempfile.mkdtemp(prefix="ctxcache-warm-up-"))
    progress, output = folder / "progress", folder / "child.log"
    t0 = time.perf_counter()
    with open(output, "wb") as out:
        child = subprocess.Popen([sys.executable, "-m", "ctxcache.service.warm_up_check", str(progress),
                                  str(os.getpid())],
                                 stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
    try:
        with contextlib.suppress(BrokenPipeError):  # a child that died at once: its status says how
            child.stdin.write(pickle.dumps(config))
            child.stdin.close()
        code = child.wait()
    finally:
        if child.poll() is None:  # interrupted while it ran
            child.kill()
            child.wait()
    lines = progress.read_text(errors="replace").splitlines() if progress.exists() else []
    if code != 0:
        tail = output.read_text(errors="replace").splitlines()[-_TAIL:]
        log.info("warm-up check child's last lines:\n%s", "\n".join(tail))
        raise WarmUpCheckFailed(failure_line(code, lines, output))
    shutil.rmtree(folder, ignore_errors=True)
    compiles = sum(line.startswith("start ") for line in lines)
    log.info("warm-up check: a child process loaded the model and warmed up in %.1f s (%d kernel compilations)",
             time.perf_counter() - t0, compiles)


def failure_line(code: int, lines: list[str], output: Path) -> str:
    """How the child ended, in one line: the signal or status, and the kernel it was compiling
    (the last one started and not done) or had compiled last."""
    errors = [line[6:] for line in lines if line.startswith("error ")]
    if errors:  # a Python error: the child wrote it as the server would have said it
        return errors[-1]
    started = [line[6:] for line in lines if line.startswith("start ")]
    in_flight = bool(started) and lines[-1].startswith("start ")  # compiles run one at a time
    where = (f"while compiling {started[-1]}" if in_flight else
             f"after compiling {started[-1]} (its last kernel)" if started else "before compiling any kernel")
    crashed = in_flight and -code in _CRASHES  # raised by the compiler itself, not sent from outside
    if code < 0:
        how = (f"{'the GPU kernel compiler' if crashed else 'the warm-up child process'} "
               f"{'aborted' if -code == signal.SIGABRT else 'died'} (signal {-code}, {_signal_name(-code)})")
    else:
        how = f"the warm-up child process exited with status {code}"
    hint = "; a Triton/LLVM bug at a shape these settings use" if crashed else ""
    return f"warm-up failed: {how} {where}{hint}. The server did not start; the child's output: {output}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _child(progress_path: str, server: int) -> int:
    """The child: the server's model, runners and warm-up, each compile reported as it starts
    and ends in the progress file (written unbuffered: an abort loses nothing)."""
    config: ServiceConfig = pickle.load(sys.stdin.buffer)
    if os.getppid() != server:  # gone already
        return 70
    threading.Thread(target=_exit_with_parent, args=(server,), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.enable()  # a native crash also leaves the Python stack it happened under in the log
    fd = os.open(progress_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    fault = _Fault(os.environ.get(FAULT_ENV, ""))

    def write(line: str) -> None:
        os.write(fd, (line + "\n").encode())
        if line.startswith("start "):
            fault.strike()
    from ctxcache.kernels.compiles import CompileCounter, report_compiles
    from ctxcache.service.assembly import decode_runners, load_configured_model
    from ctxcache.service.cli.errors import describe
    from ctxcache.service.warmup import warm_up_server

    report_compiles(write)
    try:
        lm = load_configured_model(config)
        warm_up_server(lm, decode_runners(lm, config), config, CompileCounter.install())
    except Exception as exc:  # noqa: BLE001 - one line for the server to raise
        write("error " + " ".join(describe(exc).split()))
        return 1
    fault.strike()
    return 0


class _Fault:
    """The test hook: strike() aborts or exits with a status, once, when FAULT_ENV asks."""

    def __init__(self, spec: str) -> None:
        self.spec = spec.strip()
        if self.spec and self.spec != "abort" and not (self.spec.startswith("exit:") and self.spec[5:].isdigit()):
            raise ValueError(f"{FAULT_ENV}={self.spec[:20]!r} must be abort or exit:N")

    def strike(self) -> None:
        if self.spec == "abort":
            os.abort()
        if self.spec.startswith("exit:"):
            os._exit(int(self.spec[5:]))


def _exit_with_parent(server: int) -> None:
    """A server killed while its child warms up (SIGKILL: no cleanup) leaves the child to init's
    care: then it stops instead of holding the GPU."""
    while os.getppid() == server:
        time.sleep(0.5)
    os._exit(70)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2])))
