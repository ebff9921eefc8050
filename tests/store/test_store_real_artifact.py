"""One real SmolLM2 + CSAttention artifact through the store (bit-exact, sizes as designed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctxcache.store import ArtifactStore, StoreConfig
from store_helpers import assert_same

TEXT = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def real_artifact(smollm2):  # noqa: ANN001, ANN201
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method

    lm = smollm2
    if not TEXT.exists():
        pytest.skip(f"{TEXT} missing")
    torch.manual_seed(0)
    ids = lm.tokenizer(TEXT.read_text())["input_ids"][:192]
    method = make_method("csattention", {"centroids": 16, "kmeans_iters": 3, "list_fraction": 0.25})
    return build_artifact(lm, ids, method, IndexerConfig(progress=False, kv_codec="lossless", store_queries=192))


def test_real_artifact_round_trip(real_artifact, tmp_path: Path) -> None:  # noqa: ANN001
    art = real_artifact
    with ArtifactStore(tmp_path, StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 30)) as s:
        m = s.put("real", art)
        got = s.get("real", with_queries=True)
        for_decoding = s.get("real")
        st = s.stats()
    assert_same(art, got)
    assert all(l.queries is not None and l.queries.shape == (9, 192, 64) for l in got.layers)
    assert all(l.queries is None for l in for_decoding.layers)  # decoding never loads them
    by = {(c.layer, c.name): c for c in m.chunks}
    assert by[(0, "t_list_idx")].stored_dtype == "|u1"  # int32 indices < 256 narrowed
    assert by[(0, "t_list_idx")].stored_bytes == by[(0, "t_list_idx")].raw_bytes // 4
    assert st.raw_kv_bytes == art.kv_bytes() == 30 * 2 * 3 * 192 * 64 * 2
    q_bytes = sum(l.query_bytes() for l in art.layers)
    assert st.stored_bytes < art.kv_bytes() + art.table_bytes() + q_bytes


def test_dense_rows_are_derived_not_stored(tmp_path: Path) -> None:
    """CSAttention's dense layout (int8 rows, the default) stores its centroids only (format 2);
    restored at load, the rows are the int8 products of the stored centroids and keys."""
    from ctxcache.decoder.session import restore_tables
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model

    lm = load_model("random:tiny", seed=1)
    ids = torch.randint(0, lm.args.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    method = make_method("csattention", {"centroids": 16, "kmeans_iters": 2})
    art = build_artifact(lm, ids, method, IndexerConfig(progress=False, kv_codec="lossless"))
    with ArtifactStore(tmp_path, StoreConfig(map_size_bytes=1 << 28, budget_bytes=1 << 28)) as s:
        m = s.put("a", art)
        got = s.get("a")
    assert_same(art, got)
    assert {c.name for c in m.chunks if c.layer == 0} == {"k", "v", "t_centroids"}
    assert m.raw_table_bytes < 0.1 * m.raw_kv_bytes
    tables = restore_tables(method, got, "cpu")
    for t, layer in zip(tables, got.layers):
        assert t["dense_score"].dtype == torch.int8 and t["dense_score"].shape[-1] == 200
        hkv, m_, c, db = t["centroids"].shape
        sub_k = layer.k.float().unflatten(-1, (m_, db)).permute(0, 2, 1, 3)
        want = t["centroids"].float() @ sub_k.transpose(-1, -2)
        got_rows = t["dense_score"].float() * t["dense_scale"][..., None]
        # int8 rows: within half a quantization step (plus the fp16 rounding) of the product
        torch.testing.assert_close(got_rows, want, atol=float(t["dense_scale"].max()) * 0.51 + 1e-2, rtol=1e-2)
