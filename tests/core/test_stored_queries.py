"""The indexer keeps a prefill query sample so query-built tables can be rebuilt without prefill."""

import pytest
import torch

from ctxcache.indexer import IndexerConfig, build_artifact, query_positions, reindex
from ctxcache.methods import make_method
from ctxcache.models.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def test_query_positions_keep_all_or_spread_plus_tail():
    assert query_positions(10, 16).tolist() == list(range(10))
    pos = query_positions(1000, 64)
    assert pos.numel() == 64 and pos.unique().numel() == 64 and bool((pos.diff() > 0).all())
    assert pos[0] == 0 and pos[-16:].tolist() == list(range(984, 1000))


def test_artifact_keeps_queries_and_rebuild_uses_them(tiny):
    ids = torch.randint(0, tiny.args.vocab_size, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    cs = make_method("csattention", {"subspaces": 4, "centroids": 8})
    art = build_artifact(tiny, ids, cs, IndexerConfig(progress=False, store_queries=64))
    hq, d = tiny.args.n_heads, tiny.args.head_dim
    assert all(l.queries.shape == (hq, 64, d) and l.queries.dtype == torch.float16 for l in art.layers)
    new = reindex(art, make_method("csattention", {"subspaces": 2, "centroids": 4}))
    assert new.layers[0].tables["centroids"].shape[:3] == (tiny.args.n_kv_heads, 2, 4)
    assert new.layers[0].queries is art.layers[0].queries  # carried over for the next Rebuild
    bare = build_artifact(tiny, ids, cs, IndexerConfig(progress=False, store_queries=0))
    assert all(l.queries is None for l in bare.layers)
    with pytest.raises(ValueError, match="did not store.*keep_queries"):
        reindex(bare, make_method("csattention", {"subspaces": 2, "centroids": 4}))
    same = reindex(bare, cs)  # its own method converts the stored state: no queries needed
    assert all(torch.equal(a.tables["centroids"], b.tables["centroids"]) for a, b in zip(same.layers, bare.layers))
    reindex(bare, make_method("key-kmeans"))  # key-built methods need no queries


def test_bounded_capture_keeps_exactly_the_chosen_positions(tiny):
    from ctxcache.generation import prefill
    from ctxcache.models.attention import QueryCapture

    ids = torch.randint(0, tiny.args.vocab_size, (1, 90), generator=torch.Generator().manual_seed(1))
    keep = query_positions(90, 24, tail=5)
    captures = []
    for k in (None, keep):
        cap = QueryCapture(tiny.args.n_layers, keep=k)
        prefill(tiny.model, ids, tiny.model.new_cache(1, max_len=90), cap, 7)  # chunks of 7 cut across kept runs
        captures.append(cap)
    full, bounded = captures
    for layer in range(tiny.args.n_layers):
        torch.testing.assert_close(bounded.queries(layer), full.queries(layer)[:, keep], rtol=0, atol=0)


def test_a_bounded_capture_builds_every_query_method(tiny):
    """CTkvr's centroids are the newest queries, which a bounded capture always holds."""
    ids = torch.randint(0, tiny.args.vocab_size, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    ct = make_method("ctkvr", {"centroids": 8})
    full = build_artifact(tiny, ids, ct, IndexerConfig(progress=False, capture_queries=0))
    bounded = build_artifact(tiny, ids, ct, IndexerConfig(progress=False, capture_queries=40))
    for a, b in zip(full.layers, bounded.layers):
        torch.testing.assert_close(a.tables["centroids"], b.tables["centroids"], rtol=0, atol=0)
    cs = build_artifact(tiny, ids, make_method("csattention", {"subspaces": 4, "centroids": 8}),
                        IndexerConfig(progress=False, capture_queries=40))
    assert cs.layers[0].tables["centroids"].shape[:3] == (tiny.args.n_kv_heads, 4, 8)
