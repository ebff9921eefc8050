"""Artifacts written before format 2 are served, converted by Rebuild without a prefill, and an
unknown format is refused with FAILED_PRECONDITION naming it (never misread)."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.decoder.session import restore_tables
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.store import ArtifactStore, StoreConfig

from service_helpers import ask, tiny_config

OLD, FUTURE = "a" * 64, "b" * 64


def format1(art: ContextArtifact) -> ContextArtifact:
    """The artifact as format 1 stored it: every table, the derived dense rows included."""
    method = make_method(art.method, art.method_params)
    layers = [LayerArtifact(l.k, l.v, t) for l, t in zip(art.layers, restore_tables(method, art, "cpu"))]
    return replace(art, layers=layers, format_version=1, kv_codec="lossless")


@pytest.fixture
def old_store(tiny_lm, tmp_path):
    method = make_method("csattention", {"subspaces": 4, "centroids": 8, "kmeans_iters": 2})
    ids = torch.randint(0, tiny_lm.args.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    art = build_artifact(tiny_lm, ids, method, IndexerConfig(kv_codec="lossless", progress=False))
    data = tmp_path / "data"
    with ArtifactStore(data, StoreConfig(map_size_bytes=1 << 28, budget_bytes=1 << 28)) as s:
        s.put(OLD, format1(art))
        s.put(FUTURE, replace(art, format_version=9))
    return data


def test_old_format_is_served_and_rebuild_converts_it_without_prefill(start, old_store):
    _, client = start(tiny_config(old_store))
    before = ask(client, OLD)[1]
    rebuilt = client.admin.Rebuild(apb.RebuildRequest(context_id=OLD, wait=True))
    new = rebuilt.context
    assert not rebuilt.reprefilled and new.context_id != OLD and new.format_version == 2
    old_info = client.context.GetContext(pb.GetContextRequest(context_id=OLD))
    assert old_info.format_version == 1 and new.artifact_bytes < 0.85 * old_info.artifact_bytes  # the rows are gone
    after = ask(client, new.context_id)[1]
    assert after.text == before.text and after.usage.cached_tokens == before.usage.cached_tokens == 150


def test_unknown_format_is_refused_by_name(start, old_store):
    _, client = start(tiny_config(old_store))
    with pytest.raises(grpc.RpcError) as err:
        ask(client, FUTURE)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "format_version=9" in err.value.details()
