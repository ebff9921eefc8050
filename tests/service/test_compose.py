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
        if sep:  # ${VAR:-default} with VAR unset in the shell: the default
            env[name] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
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


# ---- issue 29 #10: the images and the compose file as an operator runs them -------------------

def _services() -> dict:
    import yaml
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def _dockerfile() -> list[str]:
    """Instructions, continuation lines joined."""
    return (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()


def test_the_image_runs_as_a_non_root_user():
    lines = [l.split() for l in _dockerfile() if l.split()]
    users = [i for i, l in enumerate(lines) if l[0] == "USER"]
    assert users, "the image runs as root"
    user = lines[users[-1]][1].split(":")[0]
    assert user not in ("root", "0")
    assert not any(l[0] == "RUN" for l in lines[users[-1]:]), "a RUN after USER is not the build's last step"


def test_allow_unauthenticated_is_the_operators_choice():
    assert "--allow-unauthenticated" not in (ROOT / "Dockerfile").read_text()
    for name, svc in _services().items():
        assert "--allow-unauthenticated" not in svc.get("command", []), name
    for name in ("ctxcache", "ctxcache-gpu"):
        assert any(e.startswith("CTXCACHE_ALLOW_UNAUTHENTICATED") for e in _services()[name]["environment"]), name


def test_each_ctxcache_service_has_a_health_check_and_a_metrics_port():
    for name, svc in _services().items():
        if not name.startswith("ctxcache"):
            continue
        check = svc.get("healthcheck", {}).get("test", [])
        assert check[:3] == ["CMD", "ctxcache", "health"], (name, check)
        command = svc["command"]
        port = command[command.index("--metrics-port") + 1]
        assert any(p.endswith(f":{port}") for p in svc["ports"]), (name, svc["ports"])


def test_the_image_has_a_c_compiler_for_triton():
    """Triton compiles a small C launcher at run time (the GPU image needs gcc)."""
    installs = [l for l in _dockerfile() if l.startswith("RUN") and "apt-get install" in l]
    assert any(" gcc" in l for l in installs), installs


def test_the_health_check_command_answers_serving(start):
    srv, _ = start()
    check = _services()["ctxcache"]["healthcheck"]["test"][1:]
    address = check[check.index("--address") + 1]
    argv = [a.replace(address, f"127.0.0.1:{srv.port}") for a in check[1:]]
    from ctxcache.service.cli import main as cli
    assert cli.main(argv) == 0


@pytest.mark.parametrize("value,words", [("1", "nonexistent"), ("0", "CTXCACHE_TOKEN"), ("maybe", "'maybe'")])
def test_serve_reads_allow_unauthenticated_from_the_environment(value, words, monkeypatch, capsys, tmp_path):
    from ctxcache.service.cli import main as cli
    monkeypatch.setenv("CTXCACHE_ALLOW_UNAUTHENTICATED", value)
    rc = cli.main(["serve", "--host", "0.0.0.0", "--model", "/nonexistent", "--data", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert rc == 1 and words in err, err


def test_the_fleet_profile_is_redis_s3_one_indexer_and_two_decoders_with_valid_commands():
    """Issue 33: `--profile fleet` adds an S3 server, one indexer and two decoders on the Redis;
    each worker's command parses and makes a valid config (a fleet role without --redis or
    --object-store would fail here), and each advertises its own compose name."""
    import yaml

    from ctxcache.service.cli import commands as cli_commands, main as cli

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
