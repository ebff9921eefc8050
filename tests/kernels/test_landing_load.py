"""A cold slot load of a context still arriving from the object store (TieredStore.get_landing):
the runner copies each layer as it lands, so the slot holds layer 0 while a later layer is
still held back; the slot then holds exactly what a load of the whole artifact gives (K/V,
index rows) and the question's first logits are identical; a damaged chunk in the last layer
raises CorruptArtifact (DATA_LOSS) from the admission, before any logits, and leaves no context
in the slot. On a GPU (marked gpu) the same runs through the side stream's staged copies."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from ctxcache.decoder.gpu import slot_load
from ctxcache.landing import Landing
from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model
from ctxcache.store import CorruptArtifact, StoreConfig
from ctxcache.store.object import object_layout as lay
from ctxcache.store.object.object_config import ObjectStoreConfig
from ctxcache.store.tiered_store import TieredStore, open_store
from landing_helpers import hold_layer

CONFIG = SparseConfig(Budget(0.1, 2, 8))
PROMPT = list(range(40, 57))
# Triton's CPU interpreter is set up only where no GPU is (tests/conftest.py): there the cuda case runs instead
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the cuda case runs here")),
           pytest.param("cuda", marks=pytest.mark.gpu(reason="the side stream's staged copies"))]


@pytest.fixture(scope="module")
def built():
    cpu_lm = load_model("random:tiny", seed=3)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 4.0, "follow": 8})
    tokens = torch.randint(0, cpu_lm.args.vocab_size, (130,), generator=torch.Generator().manual_seed(7))
    art = build_artifact(cpu_lm, tokens, method, IndexerConfig(progress=False))  # int8 codes, as served
    return method, art


def worker(tmp_path: Path, name: str) -> TieredStore:
    store = open_store(tmp_path / name, StoreConfig(map_size_bytes=64 << 20, budget_bytes=32 << 20), f"file://{tmp_path / 'shared'}",
                       ObjectStoreConfig())
    assert isinstance(store, TieredStore)
    return store


def slot_state(runner: GpuRunner, n: int) -> list[torch.Tensor]:
    out = []
    for layer, t in enumerate(runner.tables):
        out += [runner.cache.k[layer][0, :, :n].cpu(), runner.cache.v[layer][0, :, :n].cpu(),
                t.centroids[0].cpu(), t.dense_score[0].cpu(), t.n_ctx[0].cpu()]
        out += [] if t.score_scale is None else [t.score_scale[0].cpu()]
    return out


def admit(lm, method, art) -> tuple[GpuRunner, torch.Tensor]:
    runner = GpuRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=64, use_graph=False)
    _, logits = runner.admit("c", art, PROMPT, CONFIG, 8)
    return runner, logits.cpu()


@pytest.mark.parametrize("where", DEVICES)
def test_a_landing_load_fills_the_slot_as_layers_land_and_as_a_whole_load_does(built, tmp_path, monkeypatch,
                                                                                 where: str) -> None:
    method, art = built
    lm = load_model("random:tiny", seed=3, device=where)
    n, last = art.n_tokens, len(art.layers) - 1
    monkeypatch.setattr(slot_load, "LOCKED_SHARE", 1)  # every layer waited for under the lock (2 here)
    with worker(tmp_path, "a") as a, worker(tmp_path, "b") as b, worker(tmp_path, "c") as c:
        a.put("c", art)
        _, whole = b.shared.fetch_decoded("c")  # the whole-artifact download, as before landing
        assert whole.landing is None
        ref_runner, ref_logits = admit(lm, method, whole)
        release = hold_layer(c, last)
        landing = c.get_landing("c")
        assert landing is not None and landing.landing is not None
        runner = GpuRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=64, use_graph=False)
        box: dict[str, torch.Tensor] = {}
        t = threading.Thread(target=lambda: box.update(logits=runner.admit("c", landing, PROMPT, CONFIG, 8)[1]))
        t.start()
        want = ref_runner.cache.k[0][0, :, :n].cpu()
        deadline = time.monotonic() + 20
        while not torch.equal(runner.cache.k[0][0, :, :n].cpu(), want):  # layer 0 is in the slot ...
            assert time.monotonic() < deadline, "layer 0 never reached the slot"
            time.sleep(0.01)
        assert t.is_alive() and not landing.landing.ready(last)  # ... while the last is still held back
        release.set()
        t.join(20)
        assert not t.is_alive()
        for got, ref in zip(slot_state(runner, n), slot_state(ref_runner, n), strict=True):
            assert got.dtype == ref.dtype and torch.equal(got, ref)
        torch.testing.assert_close(box["logits"].cpu(), ref_logits, rtol=0, atol=0)
        assert runner.slots[0].context_id == "c" and runner.loads == 1


@pytest.mark.parametrize("where", DEVICES)
def test_a_damaged_chunk_in_the_last_layer_fails_the_admission_before_any_logits(built, tmp_path, where: str) -> None:
    method, art = built
    lm = load_model("random:tiny", seed=3, device=where)
    last = len(art.layers) - 1
    with worker(tmp_path, "a") as a, worker(tmp_path, "c") as c:
        m = a.put("c", art)
        key = next(k for k in lay.chunk_keys(m) if k.endswith(f"/{last}.k"))
        data = a.shared.tier.get(key)
        a.shared.tier.put(key, data[:9] + bytes([data[9] ^ 4]) + data[10:])
        landing = c.get_landing("c")
        assert landing is not None and landing.landing is not None
        runner = GpuRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=64, use_graph=False)
        slot, _ = runner.admit("other", art, PROMPT, CONFIG, 8)  # a resident context in the only slot
        runner.release(slot)
        with pytest.raises(CorruptArtifact, match="checksum"):
            runner.admit("c", landing, PROMPT, CONFIG, 8)
        # found before a slot was claimed: the resident context stays
        assert runner.slots[0].context_id == "other" and not runner.slots[0].busy and runner.loads == 1


def test_a_wait_for_layers_before_the_lock_runs_the_callers_check(monkeypatch) -> None:
    """land_ahead on a download that never lands ends when the caller's check raises (a
    cancelled stream or a passed deadline), not when the download gives up."""
    monkeypatch.setattr(slot_load, "POLL_S", 0.01)
    art = type("Art", (), {"landing": Landing([None, 0, 1], 2), "layers": [None, None]})()
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the client cancelled the stream")

    with pytest.raises(RuntimeError, match="cancelled"):
        slot_load.land_ahead(art, check)
    assert len(calls) == 3
