"""build_artifact's layer-major prefill: a layer's K/V reach the store writer as soon as that
layer's prefill ends (before the next layer runs), its tables once built; the artifact is
bitwise what the chunk-major prefill gives."""

from __future__ import annotations

import pytest
import torch

from ctxcache.generation import prefill
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.models.attention import dense_attention
from ctxcache.models.loader import load_model
from ctxcache.store.layout import layer_chunks

N, CHUNK = 150, 32


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


class RecordingWriter:
    def __init__(self, events: list) -> None:
        self.events = events

    def add_layer(self, index, layer, kv_codec, ready=None) -> None:  # noqa: ANN001
        ready()
        self.events.append(("hand", index, tuple(name for (_, name), _ in layer_chunks(index, layer, kv_codec))))


def _build(lm, writer, codec: str = "int8"):  # noqa: ANN001, ANN202
    method = make_method("csattention", {"subspaces": 4, "centroids": 8, "kmeans_iters": 2})
    ids = torch.randint(0, lm.args.vocab_size, (N,), generator=torch.Generator().manual_seed(0))
    config = IndexerConfig(chunk=CHUNK, kv_codec=codec, progress=False, coded_kv=True)
    return ids, build_artifact(lm, ids, method, config, writer)


def test_a_layers_kv_is_handed_over_before_the_next_layer_runs(tiny) -> None:
    events: list = []
    hooks = [block.register_forward_pre_hook(lambda m, a, i=i: events.append(("block", i)))
             for i, block in enumerate(tiny.model.model.layers)]
    try:
        _build(tiny, RecordingWriter(events))
    finally:
        for h in hooks:
            h.remove()
    chunks = -(-N // CHUNK)
    # every chunk of layer 0, then its K/V (the CPU build indexes it before layer 1 too)
    assert events[:chunks + 1] == [("block", 0)] * chunks + [("hand", 0, ("k", "k_scale", "v", "v_scale"))]
    assert events.index(("block", 1)) > chunks
    tables = [e for e in events if e[0] == "hand" and any(n.startswith("t_") for n in e[2])]
    assert [e[1] for e in tables] == [0, 1]  # then each layer whole, tables included


def test_the_built_kv_and_logits_are_bitwise_the_chunk_major_prefills(tiny) -> None:
    ids, art = _build(tiny, None, "lossless")
    cache = tiny.model.new_cache(1, max_len=N)
    logits = prefill(tiny.model, ids[None], cache, dense_attention, CHUNK)
    assert torch.equal(art.last_logits, logits[0].float())
    for i, layer in enumerate(art.layers):
        assert torch.equal(layer.k, cache.k[i][0].half()) and torch.equal(layer.v, cache.v[i][0].half())
