"""Issue 22 #13: the CLI's everyday mistakes are one line on stderr and a non-zero exit."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from ctxcache.service.cli import main as cli
from ctxcache.client.gen.v1 import context_pb2 as pb

from service_helpers import put_text


@pytest.fixture
def files(tmp_path):
    (tmp_path / "binary.bin").write_bytes(b"\xff\xfe\x00\x81" * 100)
    (tmp_path / "no_content.json").write_text('[{"role": "system"}]')
    (tmp_path / "table.parquet").write_text("this is not parquet")
    (tmp_path / "ok.txt").write_text("hello")
    return tmp_path


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


CASES = {  # name -> (argv with {d} = files dir, env, expected words in the line)
    "missing file": (["put", "--text", "{d}/nope.txt"], {}, "no such file"),
    "binary file": (["put", "--text", "{d}/binary.bin"], {}, "not UTF-8"),
    "negative max tokens": (["generate", "x", "q", "--max-tokens", "-5"], {}, "must be >= 1"),
    "bad params JSON": (["put", "--text", "{d}/ok.txt", "--method", "csattention", "--params", "[bad"], {}, "not JSON"),
    "messages without content": (["put", "--messages", "{d}/no_content.json"], {}, "'content'"),
    "documents not parquet": (["put", "--documents", "{d}/table.parquet"], {}, "Parquet"),
    "empty CTXCACHE_TOKEN": (["serve", "--model", "random:tiny", "--data", "{d}/s"], {"CTXCACHE_TOKEN": ""}, "set but empty"),
    "port in use": (["serve", "--model", "random:tiny", "--data", "{d}/s", "--port", "{busy}"], {}, "bind"),
    "nonexistent model": (["serve", "--model", "/nonexistent", "--data", "{d}/s"], {}, "nonexistent"),
    "open on a public host": (["serve", "--model", "random:tiny", "--host", "0.0.0.0", "--data", "{d}/s"], {},
                              "CTXCACHE_TOKEN"),
    "server method params out of bounds": (["serve", "--model", "random:tiny", "--data", "{d}/s", "--method-params",
                                             '{{"rerank": 99}}'], {}, "rerank=99"),
    "server method params not an object": (["serve", "--model", "random:tiny", "--data", "{d}/s", "--method-params",
                                            "[1]"], {}, "JSON object"),
    "cuda on a CPU torch": (["serve", "--model", "random:tiny", "--device", "cuda", "--data", "{d}/s"], {}, "CUDA"),
    "slots and memory both": (["serve", "--model", "random:tiny", "--data", "{d}/s", "--gpu-slots", "2",
                               "--gpu-memory-gb", "4"], {}, "not both"),
    "no memory": (["serve", "--model", "random:tiny", "--data", "{d}/s", "--gpu-memory-gb", "0"], {}, "must be > 0"),
    "unreachable server": (["admin", "--address", "127.0.0.1:{free}", "stats"], {}, "ctxcache serve"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_everyday_mistakes_are_one_line(name, files, capsys, monkeypatch):
    argv, env, words = CASES[name]
    if name == "cuda on a CPU torch" and torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    busy = _busy_port()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    free_port = free.getsockname()[1]
    free.close()  # nothing listens there
    argv = [a.format(d=files, busy=busy.getsockname()[1], free=free_port) for a in argv]
    try:
        with pytest.raises(SystemExit) if name == "negative max tokens" else _nothing():
            rc = cli.main(argv)
    finally:
        busy.close()
    err = capsys.readouterr().err.strip()
    if name != "negative max tokens":
        assert rc != 0
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err, err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_address_without_port_means_the_default_port():
    assert cli.address("localhost") == "localhost:50051"
    assert cli.address("10.0.0.2:7000") == "10.0.0.2:7000"
    assert cli.address("[::1]") == "[::1]:50051"


def test_put_prints_the_id_and_json_on_request(start, files, capsys):
    srv, client = start()
    address = f"127.0.0.1:{srv.port}"
    assert cli.main(["put", "--text", f"{files}/ok.txt", "--address", address]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out) == 64 and out.isalnum()
    assert cli.main(["put", "--text", f"{files}/ok.txt", "--address", address, "--json"]) == 0
    assert '"context_id"' in capsys.readouterr().out


def test_ctrl_c_during_put_prints_the_id(start, files, capsys, monkeypatch):
    srv, client = start()
    from test_drain import SLOW
    (files / "long.txt").write_text("abc " * 180)

    def interrupt(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", interrupt)
    rc = cli.main(["put", "--text", f"{files}/long.txt", "--address", f"127.0.0.1:{srv.port}",
                   "--method", "csattention", "--params", str(SLOW).replace("'", '"')])
    captured = capsys.readouterr()
    assert rc == 130 and len(captured.out.strip()) == 64 and "goes on" in captured.err


def test_admin_output_shows_defaults_and_a_no_op_evict_fails(start, capsys, tmp_path):
    from service_helpers import tiny_config
    srv, client = start(tiny_config(tmp_path / "d", redis_url="redis://127.0.0.1:1/0"))  # nothing there
    address = f"127.0.0.1:{srv.port}"
    assert cli.main(["admin", "--address", address, "stats"]) == 0
    assert '"registry_available": false' in capsys.readouterr().out  # printed although the proto default
    assert cli.main(["admin", "--address", address, "evict", "0" * 64]) == 1
    captured = capsys.readouterr()
    assert '"evicted": false' in captured.out and "nothing evicted" in captured.err
