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
    return build_artifact(lm, ids, method, IndexerConfig(progress=False))


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


def test_int8_dense_tables_round_trip(tmp_path: Path) -> None:
    """CSAttention table_dtype="int8": int8 rows + fp32 row scales go through the store bit-exact,
    stored as int8 (half the fp16 table bytes before compression)."""
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model

    lm = load_model("random:tiny", seed=1)
    ids = torch.randint(0, lm.args.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for dtype in ("float16", "int8"):
        method = make_method("csattention", {"centroids": 16, "kmeans_iters": 2, "table_dtype": dtype})
        art = build_artifact(lm, ids, method, IndexerConfig(progress=False))
        with ArtifactStore(tmp_path / dtype, StoreConfig(map_size_bytes=1 << 28, budget_bytes=1 << 28)) as s:
            m = s.put("a", art)
            assert_same(art, s.get("a", with_queries=True))
        sizes[dtype] = art.table_bytes()
        if dtype == "int8":
            by = {(c.layer, c.name): c for c in m.chunks}
            assert by[(0, "t_dense_score")].stored_dtype == "|i1"
            assert art.layers[0].tables["dense_scale"].dtype == torch.float32
    assert sizes["int8"] < 0.6 * sizes["float16"]
