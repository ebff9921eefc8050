"""Issue 50: `auto` is the default decode mode, picks per device and context length, and says
what it picked in Final.decode_path and `admin stats`; `sparse` and `dense` stay explicit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ctxcache.client.gen.v1 import admin_pb2 as apb
from ctxcache.service.config import DecoderSettings, ServiceConfig
from service_helpers import ask, put_text, tiny_config


def _config(data: Path, mode: str | None) -> ServiceConfig:
    cfg = tiny_config(data)
    decoder = replace(cfg.decoder, decode_mode=mode) if mode else DecoderSettings(dram_cache_bytes=256 << 20)
    return replace(cfg, decoder=decoder)


@pytest.mark.parametrize(("mode", "path", "said"), [
    (None, "reference-dense", "auto: dense at every context length (cpu)"),  # the default
    ("sparse", "reference", "sparse"),
    ("dense", "reference-dense", "dense"),
])
def test_decode_mode_is_reported(start, tmp_path, mode, path, said) -> None:
    _, client = start(_config(tmp_path / "data", mode))
    cid = put_text(client).context_id
    finals = [ask(client, cid)[1] for _ in range(2)]
    assert [f.decode_path for f in finals] == [path, path]
    stats = client.admin.Stats(apb.StatsRequest())
    assert stats.decode_mode == said and dict(stats.streams_by_decode_path) == {path: 2}


def test_default_is_auto() -> None:
    assert DecoderSettings().decode_mode == "auto"
    with pytest.raises(ValueError, match="decode_mode='fast'"):
        DecoderSettings(decode_mode="fast")
