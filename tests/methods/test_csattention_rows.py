"""CSAttention stores its centroids and derives the dense rows at load: the derived rows are the
built ones, and the other layouts store what they build."""

from __future__ import annotations

import pytest
import torch

from ctxcache.methods import make_method


def _qkv(n: int = 96, hq: int = 4, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(hq, n, d, generator=g), torch.randn(hkv, n, d, generator=g),
            torch.randn(hkv, n, d, generator=g))


@pytest.mark.parametrize("table_dtype", ["int8", "float16"])
def test_restore_derives_exactly_the_built_rows(table_dtype: str) -> None:
    method = make_method("csattention", {"subspaces": 4, "centroids": 8, "kmeans_iters": 2, "table_dtype": table_dtype})
    q, k, v = _qkv()
    built = method.build(q, k, v)
    kept = method.persist(built)
    assert set(kept) == {"centroids"}
    restored = method.restore(kept, k)
    assert set(restored) == set(built)
    for name in built:
        assert restored[name].dtype == built[name].dtype and torch.equal(restored[name], built[name]), name
    derived = sum(t.numel() * t.element_size() for n, t in built.items() if n != "centroids")
    assert method.derived_bytes(k.shape[1], k.shape[0]) == derived
    assert method.restore(built, k) is built  # rows already there (format 1): used as stored


def test_list_layout_stores_what_it_builds() -> None:
    method = make_method("csattention", {"subspaces": 4, "centroids": 8, "kmeans_iters": 2, "list_fraction": 0.25})
    q, k, v = _qkv()
    built = method.build(q, k, v)
    assert method.persist(built) == built and method.restore(built, k) is built
    assert method.derived_bytes(96, 2) == 0


@pytest.mark.parametrize("table_dtype", ["int8", "float16"])
def test_rows_computed_per_step_equal_the_materialized_rows(table_dtype: str) -> None:
    """The CPU reference computes only the routed rows each step (restore on_demand): the same
    estimates, bit for bit, as reading the materialized rows (what the GPU runner loads)."""
    method = make_method("csattention", {"subspaces": 4, "centroids": 8, "kmeans_iters": 2, "table_dtype": table_dtype})
    q, k, v = _qkv()
    k = k.half()  # as stored
    kept = method.persist(method.build(q, k.float(), v))
    lazy, full = method.restore(kept, k, on_demand=True), method.restore(kept, k)
    assert "dense_score" not in lazy and "dense_score" in full
    for i in range(5):
        query = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        a, b = method.estimate(method.open(lazy), query, 96), method.estimate(method.open(full), query, 96)
        assert torch.equal(a, b)
