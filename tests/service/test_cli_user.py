"""Issue 29 #8: the CLI as a new user meets it (a real server on port 0 where one is needed)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.cli import main as cli

from service_helpers import TEXT, put_text

CTXCACHE = str(Path(sys.executable).parent / "ctxcache")
ID = "0" * 64
CLIENT_COMMANDS = {  # every command that talks to a server
    "put": ["put", "--text", "{f}"],
    "generate": ["generate", ID, "question"],
    "health": ["health"],
    **{f"admin {c}": ["admin", c, *a] for c, a in
       [("list", []), ("show", [ID]), ("describe", [ID]), ("evict", [ID]), ("rebuild", [ID]), ("verify", []),
        ("stats", []), ("reconcile", [])]},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "ctx.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("name", list(CLIENT_COMMANDS))
def test_with_no_server_every_command_fails_in_one_line_within_3_s(name, text_file):
    """The whole command as a user runs it (a new process), against a port where nothing listens."""
    address = f"127.0.0.1:{_free_port()}"
    words = [a.format(f=text_file) for a in CLIENT_COMMANDS[name]]
    argv = [words[0], f"--address={address}", *words[1:]]
    t0 = time.perf_counter()
    out = subprocess.run([CTXCACHE, *argv], capture_output=True, text=True, timeout=30)
    elapsed = time.perf_counter() - t0
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert address in lines[0] and "ctxcache serve" in lines[0], lines[0]
    assert elapsed < 3.0, f"{name}: {elapsed:.2f} s"


def test_put_params_are_json_and_apply_to_the_default_method(start, text_file, capsys):
    srv, _ = start()  # default method: key-kmeans
    address = f"--address=127.0.0.1:{srv.port}"
    assert cli.main(["put", "--text", str(text_file), address, "--params", "{keys_per_cluster:8}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--params is not JSON" in err, err
    assert cli.main(["put", "--text", str(text_file), address, "--params", '{"keys_per_cluster": 8}', "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["method"] == "key-kmeans" and info["method_params"]["keys_per_cluster"] == 8
    assert type(info["method_params"]["keys_per_cluster"]) is int and type(info["created_unix_ms"]) is int


def _blocked_builds(monkeypatch) -> threading.Event:
    """Builds wait for the returned event (set it to let them finish)."""
    from ctxcache.indexer import build_queue
    release, real = threading.Event(), build_queue.build_artifact

    def build(*a, **kw):
        release.wait(30)
        return real(*a, **kw)
    monkeypatch.setattr(build_queue, "build_artifact", build)
    return release


def test_admin_list_shows_building_contexts_with_a_header_and_the_state(start, text_file, capsys, monkeypatch):
    srv, client = start()
    ready = put_text(client, TEXT + " ready").context_id
    release = _blocked_builds(monkeypatch)
    try:
        building = client.put(pb.PutContextRequest(text=TEXT, wait=False)).context.context_id
        assert cli.main(["admin", f"--address=127.0.0.1:{srv.port}", "list"]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
    finally:
        release.set()
    assert lines[0].split()[:4] == ["CONTEXT", "ID", "STATE", "TOKENS"], lines[0]
    rows = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert rows == {ready: "READY", building: "BUILDING"}, lines


def test_list_pages_merge_stored_and_building_contexts(start, monkeypatch):
    srv, client = start()
    stored = {put_text(client, f"{TEXT} {i}").context_id for i in range(3)}
    release = _blocked_builds(monkeypatch)
    try:
        building = {client.put(pb.PutContextRequest(text=f"{TEXT} b{i}", wait=False)).context.context_id
                    for i in range(2)}
        seen, token = [], ""
        while True:
            page = client.context.ListContexts(pb.ListContextsRequest(page_size=2, page_token=token))
            seen += [c.context_id for c in page.contexts]
            token = page.next_page_token
            if not token:
                break
    finally:
        release.set()
    assert seen == sorted(stored | building)


def test_rebuild_without_method_converts_and_the_reprefill_error_names_the_flag(start, text_file, capsys):
    srv, client = start()
    cid = put_text(client).context_id
    address = f"--address=127.0.0.1:{srv.port}"
    assert cli.main(["admin", address, "rebuild", cid]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["context"]["state"] == "CONTEXT_STATE_READY" and out["context"]["method"] == "key-kmeans"
    rc = cli.main(["admin", address, "rebuild", cid, "--method", "csattention", "--params",
                   '{"subspaces": 2, "centroids": 4}'])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "--allow-reprefill" in err, err


def test_show_and_describe_print_typed_values_in_a_stable_order(start, capsys):
    srv, client = start()
    spec = pb.MethodSpec(name="csattention")
    spec.params.update({"backoff_cos": 0.25})
    cid = put_text(client, method=spec).context_id
    address = f"--address=127.0.0.1:{srv.port}"
    outputs = []
    for command in ("show", "describe", "show", "describe"):
        assert cli.main(["admin", address, command, cid]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[2] and outputs[1] == outputs[3]
    shown, described = json.loads(outputs[0]), json.loads(outputs[1])
    params = shown["method_params"]
    assert list(params) == sorted(params)
    assert type(params["subspaces"]) is int and type(params["centroids"]) is int
    assert params["backoff_cos"] == 0.25  # a fraction stays a float
    for key in ("created_unix_ms", "artifact_bytes", "raw_kv_bytes", "n_tokens"):
        assert type(shown[key]) is int and shown[key] > 0, key
    assert all(type(v) is int for v in described["stored_bytes_by_part"].values())
    assert list(shown)[:3] == ["context_id", "state", "progress"]  # the record's own field order


def test_put_progress_bar_counts_percent_without_a_rate(start, text_file, capsys):
    srv, _ = start()
    assert cli.main(["put", "--text", str(text_file), f"--address=127.0.0.1:{srv.port}"]) == 0
    err = capsys.readouterr().err
    assert "build" in err and "100%" in err and "%/s" not in err, err


def test_serve_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    for flag, default in (("--model MODEL", "smollm2"), ("--device DEVICE", "cpu"), ("--port PORT", "50051"),
                          ("--data DATA", "./data")):
        after = text.split(flag, 1)[1].split(" --", 1)[0]
        assert f"(default: {default})" in after, (flag, after)
    model_help = text.split("--model MODEL", 1)[1].split("(default", 1)[0]
    assert "Hugging Face" in model_help


def test_generate_local_decodes_on_the_server_engine_and_prints_timings(text_file, capsys):
    rc = cli.main(["generate-local", "--text", str(text_file), "Where is the lighthouse?", "--model", "random:tiny",
                   "--device", "cpu", "--dtype", "float32", "--method", "key-kmeans", "--max-tokens", "4"])
    assert rc == 0
    timing = capsys.readouterr().err.strip().splitlines()[-1]
    for words in ("context tokens", "prefill", "ttft", "tok/s", "decoded by reference"):
        assert words in timing, timing


def test_the_server_logs_one_access_line_per_rpc(start, caplog):
    srv, client = start()
    with caplog.at_level(logging.INFO, logger="ctxcache.access"):
        cid = put_text(client).context_id
        client.context.GetContext(pb.GetContextRequest(context_id=cid))
        with pytest.raises(Exception):
            client.context.GetContext(pb.GetContextRequest(context_id=ID))
        list(client.generate(pb.GenerateRequest(context_id=cid, question="secret question",
                                                sampling=pb.SamplingParams(max_tokens=2))))
        deadline = time.monotonic() + 5
        while len(caplog.records) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxcache.access"]
    assert len(lines) == 4, lines
    expect = [("ctxcache.v1.ContextService/PutContext", cid, "OK"), ("ctxcache.v1.ContextService/GetContext", cid, "OK"),
              ("ctxcache.v1.ContextService/GetContext", ID, "NOT_FOUND"),
              ("ctxcache.v1.ContextService/Generate", cid, "OK")]
    for line, (method, context_id, status) in zip(lines, expect):
        parts = line.split()
        assert parts[:3] == [method, context_id, status] and parts[4] == "ms" and float(parts[3]) >= 0, line
    assert not any("secret" in line or "lighthouse" in line for line in lines)


@pytest.mark.timeout(120)
def test_serve_writes_the_access_log_at_info_by_default(tmp_path):
    proc = subprocess.Popen([CTXCACHE, "serve", "--model", "random:tiny", "--port", "0", "--data", str(tmp_path / "d")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving on" in line, proc.stderr.read() if proc.poll() is not None else line
        port = line.split("serving on ", 1)[1].split()[0].rsplit(":", 1)[1]
        assert cli.main(["admin", f"--address=127.0.0.1:{port}", "list"]) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert "ctxcache.v1.ContextService/ListContexts - OK" in err, err[-2000:]
