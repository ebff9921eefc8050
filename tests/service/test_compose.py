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


def test_dockerfile_copies_every_package_folder():
    """setup.py maps top-level folders to packages: an image without one fails at import."""
    import ast
    tree = ast.parse((ROOT / "setup.py").read_text())
    roots = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ROOTS")
    folders = {v.value for v in roots.values}
    copied = {line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    assert folders <= copied, f"Dockerfile does not COPY {sorted(folders - copied)}"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~14 s on 2 busy cores: torch import and the SmolLM2 load of the real command
def test_the_compose_command_starts_with_no_environment(tmp_path):
    """Issue 22 #14: the ctxcache service's exact command and environment, with an empty shell
    environment, starts and serves; only what Docker would map is mapped (volumes to folders,
    published ports to free ports, the image's `ctxcache` to this venv's)."""
    import os
    import re
    import signal
    import sys

    import grpc
    import yaml
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ctxcache.models.loader import cache_root

    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["ctxcache"]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    for item in svc["environment"]:  # list form: "NAME" passes the shell's value (unset here), "NAME=v" sets v
        name, sep, value = item.partition("=")
        if sep:
            env[name] = value
    volumes = {"/data": str(tmp_path / "data"), "/models": str(cache_root())}
    env = {k: volumes.get(v, v) for k, v in env.items()}
    ports = {p: str(_free_port()) for p in ("50051", "50052", "9100")}
    cmd = [volumes.get(a, ports.get(a, a)) for a in svc["command"]]
    assert cmd[0] == "ctxcache"
    cmd[0] = str(Path(sys.executable).parent / "ctxcache")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving on 0.0.0.0:" in line, proc.stderr.read()[-2000:] if proc.poll() is not None else line
        with grpc.insecure_channel(f"127.0.0.1:{ports['50051']}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_fleet_profile_is_redis_s3_one_indexer_and_two_decoders_with_valid_commands():
    """Issue 33: `--profile fleet` adds an S3 server, one indexer and two decoders on the Redis;
    each worker's command parses and makes a valid config (a fleet role without --redis or
    --object-store would fail here), and each advertises its own compose name."""
    import yaml

    from ctxcache.service import cli, cli_commands

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    fleet = {name: s for name, s in services.items() if "fleet" in s.get("profiles", [])}
    assert "profiles" not in services["redis"] and "seaweedfs" in fleet
    roles = {}
    for name, s in fleet.items():
        if s["command"][0] != "ctxcache":
            continue
        args = cli.build_parser().parse_args(s["command"][1:])
        cfg = cli_commands.service_config(args, args.port, args.host, args.admin_port)
        assert cfg.server.advertise == f"{name}:{args.port}"
        assert "seaweedfs:8333" in cfg.store.object_store_uri and "redis:6379" in cfg.registry.redis_url
        roles[name] = cfg.fleet.role
    assert sorted(roles.values()) == ["decoder", "decoder", "indexer"]
