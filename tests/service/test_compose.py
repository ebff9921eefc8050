"""docker-compose.yml validates with `docker-compose config` (no engine needed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_file_validates(profile):
    cmd = _compose()
    if cmd is None:
        pytest.skip("neither docker-compose nor `docker compose` is installed (apt-get install docker-compose)")
    args = [*cmd, "-f", str(ROOT / "docker-compose.yml")]
    if profile:
        args += ["--profile", profile]
    out = subprocess.run([*args, "config"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "redis" in out.stdout and "ctxcache" in out.stdout
    if profile:
        assert "ctxcache-gpu" in out.stdout


def test_dockerfile_runs_the_cli():
    text = (ROOT / "Dockerfile").read_text()
    assert "ctxcache" in text and "serve" in text
