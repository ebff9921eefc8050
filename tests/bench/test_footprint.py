"""bench footprint's arithmetic: index bytes against the K/V, and the Pareto front."""

from ctxcache.bench.footprint import index_over_kv, mark_pareto


def test_index_over_kv_counts_rows_scales_and_centroids() -> None:
    # head_dim 128, m=8, C=32, 8-bit rows: 256 row bytes per token and KV head vs 512 of K/V,
    # plus per layer 8*32 fp32 scales and 8*32*16 fp16 centroids per KV head
    n, hkv = 4096, 8
    want = (hkv * 8 * 32 * (n + 4) + hkv * 8 * 32 * 16 * 2) / (hkv * n * 512)
    assert index_over_kv(n, hkv, 128, 8, 32, 8) == want
    assert abs(index_over_kv(n, hkv, 128, 8, 64, 4) - want) < 0.01  # twice the rows at half the bits


def test_pareto_front_is_per_text() -> None:
    rows = [{"text": "a", "index_over_kv": 1.0, "mass_recall": 0.9}, {"text": "a", "index_over_kv": 2.0, "mass_recall": 0.8},
            {"text": "b", "index_over_kv": 2.0, "mass_recall": 0.5}]
    mark_pareto(rows)
    assert [r["pareto"] for r in rows] == [True, False, True]
