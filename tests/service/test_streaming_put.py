"""Issue 44, PutContext: a build's chunks go to the object store, or to the local LMDB when it is
the only store, while the build goes on (each layer as it is built), and a failed upload fails
the put with nothing registered or left."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ctxcache.cancel import CancellableMethod
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.indexer import build_queue
from ctxcache.store import BuildState, StoreUnavailable
from ctxcache.store.object import object_layout as lay

from service_helpers import ask, put_text
from test_shared_store import shared_config

LAST_LAYER_S = 0.5  # the last layer's build, made slow: what was handed over before goes up meanwhile


def record_uploads(srv) -> list[tuple[str, float]]:  # noqa: ANN001 (the server)
    """(key, when it was stored) of every object the server's object store writes from now on."""
    tier, done = srv.backend.store.shared.tier.inner, []
    put = tier.put

    def recorded(key: str, data) -> None:  # noqa: ANN001
        put(key, data)
        done.append((key, time.monotonic()))
    tier.put = recorded
    return done


def test_chunks_are_uploaded_before_the_builds_last_layer_is_built(start, tmp_path: Path, monkeypatch) -> None:
    last_layer: list[float] = []

    class SlowLastLayer(CancellableMethod):
        def build_layers(self, layers, n_layers: int):  # noqa: ANN001, ANN201
            for i, tables in enumerate(super().build_layers(layers, n_layers)):
                if i == n_layers - 1:
                    time.sleep(LAST_LAYER_S)
                    last_layer.append(time.monotonic())  # the last layer's tables exist from here
                yield tables

    monkeypatch.setattr(build_queue, "CancellableMethod", SlowLastLayer)
    srv, client = start(shared_config(tmp_path / "a", f"file://{tmp_path / 'shared'}"))
    uploads = record_uploads(srv)
    cid = put_text(client).context_id
    m = srv.backend.store.shared.manifest(cid)
    first = {k: t for k, t in uploads if k in lay.chunk_keys(m) and k.rsplit("/", 1)[1].startswith("0.")}
    assert len(first) == sum(c.layer == 0 for c in m.chunks) > 0
    assert len(last_layer) == 1 and max(first.values()) < last_layer[0]  # layer 0 was up before
    assert m.store_format == 3 and lay.folder_of(m).endswith(m.write_id)  # under the id chosen first
    manifest_at = next(t for k, t in uploads if k == lay.manifest_key(cid))
    assert manifest_at > max(t for k, t in uploads if k.startswith(lay.CHUNKS))  # the manifest last
    assert ask(client, cid)[1].usage.cached_tokens > 0  # and the context serves


def test_a_failed_upload_fails_the_put_in_one_line_and_leaves_nothing(start, tmp_path: Path) -> None:
    srv, client = start(shared_config(tmp_path / "a", f"file://{tmp_path / 'shared'}"))
    store = srv.backend.store
    tier = store.shared.tier.inner
    put, tried = tier.put, threading.Event()

    def refuse_layer_1(key: str, data) -> None:  # noqa: ANN001
        if "/1." in key:
            tried.set()
            raise tier.unavailable("put", key, OSError("No space left on device"))
        put(key, data)
    tier.put = refuse_layer_1
    info = put_text(client)
    assert tried.is_set()
    assert info.state == pb.CONTEXT_STATE_FAILED, info
    assert info.error == "StoreUnavailable: object store unavailable"  # its public line (the log has the key)
    assert srv.backend.registry.get(info.context_id).state == BuildState.FAILED  # never READY
    # (read past the guard: its breaker, opened by the failure, refuses calls for 2 s)
    assert tier.get(lay.manifest_key(info.context_id)) is None and store.local.manifest(info.context_id) is None
    deadline = time.monotonic() + 10  # the writer removes its chunks once the breaker has shut
    while tier.list(lay.CHUNKS) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.list(lay.CHUNKS) == []
    assert store.gc(grace_s=0).orphan_chunks == 0
    tier.put = put  # the store is back: the same put builds and serves
    assert put_text(client).state == pb.CONTEXT_STATE_READY


def test_an_upload_failing_while_the_store_stays_down_is_collected_by_gc(start, tmp_path: Path) -> None:
    srv, client = start(shared_config(tmp_path / "a", f"file://{tmp_path / 'shared'}"))
    store = srv.backend.store
    tier = store.shared.tier.inner
    put, delete_dir = tier.put, tier.delete_prefix

    def refuse_layer_1(key: str, data) -> None:  # noqa: ANN001
        if "/1." in key:
            raise StoreUnavailable(f"object store {tier.uri}: put {key}: connection refused")
        put(key, data)

    def down(prefix: str) -> None:
        raise StoreUnavailable(f"object store {tier.uri}: delete_prefix {prefix}: connection refused")
    tier.put, tier.delete_prefix = refuse_layer_1, down
    assert put_text(client).state == pb.CONTEXT_STATE_FAILED
    time.sleep(2.5)  # the writer's second try at removing its chunks (after the breaker's 2 s) failed too
    left = tier.list(lay.CHUNKS)
    assert left and all("/0." in o.key or "/ctx." in o.key for o in left)  # layer 0 went up, nothing named it
    tier.put, tier.delete_prefix = put, delete_dir
    time.sleep(2.1)  # the breaker that second failure opened shuts
    assert store.gc(grace_s=3600).orphan_chunks == 0  # young: a live writer's, for all gc knows
    assert store.gc(grace_s=0).orphan_chunks == len(left)
    assert store.shared.tier.list(lay.CHUNKS) == []


@pytest.mark.gpu
def test_a_gpu_builds_streamed_chunks_are_the_bytes_of_its_finished_artifact(tmp_path: Path) -> None:
    """Each layer's host copies are asynchronous on a GPU: the writer must encode them only once
    landed (host_copies_mark), or it would store bytes other than the artifact's."""
    import torch

    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model
    from ctxcache.store import ArtifactStore, ObjectArtifactStore

    lm = load_model("random:tiny", torch.float16, "cuda")
    tokens = torch.randint(3, 500, (900,), generator=torch.Generator().manual_seed(5))
    with ObjectArtifactStore(f"file://{tmp_path / 'shared'}") as s, ArtifactStore(tmp_path / "lmdb") as local:
        w = s.writer("c1")
        art = build_artifact(lm, tokens, make_method("csattention"),
                             IndexerConfig(progress=False, coded_kv=True), w)
        m = w.finish(art)
        ref = local.put("c1", art)  # encoded from the finished artifact, all copies landed
        assert [(c.label(), c.sha256) for c in m.chunks] == [(c.label(), c.sha256) for c in ref.chunks]


def test_the_local_store_commits_layers_before_the_builds_last_layer_is_built(start, monkeypatch) -> None:
    """LMDB alone (the default store): each layer's chunks are committed as it is handed over
    (store/lmdb/stream_writer.py), the manifest last."""
    at_last_layer: list[list[str]] = []
    srv = None

    class SlowLastLayer(CancellableMethod):
        def build_layers(self, layers, n_layers: int):  # noqa: ANN001, ANN201
            for i, tables in enumerate(super().build_layers(layers, n_layers)):
                if i == n_layers - 1:
                    time.sleep(LAST_LAYER_S)  # the writer thread commits what was handed over
                    with srv.backend.store._env.begin() as txn:
                        at_last_layer.append([bytes(k).decode() for k, _ in txn.cursor()])
                yield tables

    monkeypatch.setattr(build_queue, "CancellableMethod", SlowLastLayer)
    srv, client = start()
    cid = put_text(client).context_id
    m = srv.backend.store.manifest(cid)
    keys = at_last_layer[0]
    assert not any(k.startswith("ctxcache:v1:manifest:") for k in keys)  # not READY then
    assert sum(f":{cid}:0:" in k for k in keys) == sum(c.layer == 0 for c in m.chunks) > 0  # layer 0 in
    assert ask(client, cid)[1].usage.cached_tokens > 0


@pytest.mark.gpu
def test_a_gpu_builds_chunks_streamed_into_lmdb_are_the_bytes_of_its_finished_artifact(tmp_path: Path) -> None:
    """The LMDB writer also encodes a layer only once its host copies landed."""
    import torch

    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model
    from ctxcache.store import ArtifactStore

    lm = load_model("random:tiny", torch.float16, "cuda")
    tokens = torch.randint(3, 500, (900,), generator=torch.Generator().manual_seed(5))
    with ArtifactStore(tmp_path / "a") as s, ArtifactStore(tmp_path / "b") as ref_store:
        w = s.writer("c1")
        art = build_artifact(lm, tokens, make_method("csattention"),
                             IndexerConfig(progress=False, coded_kv=True), w)
        m = w.finish(art)
        ref = ref_store.put("c1", art)
        assert [(c.label(), c.sha256) for c in m.chunks] == [(c.label(), c.sha256) for c in ref.chunks]
        assert s.verify("c1").ok
