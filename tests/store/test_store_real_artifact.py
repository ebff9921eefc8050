"""One real SmolLM2 + CSAttention artifact through the store (bit-exact, sizes as designed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctxcache.store import ArtifactStore, StoreConfig
from store_helpers import assert_same

TEXT = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def real_artifact():  # noqa: ANN201
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model

    try:
        lm = load_model("smollm2")
    except Exception as exc:  # noqa: BLE001 (no bundled model here: nothing to test)
        pytest.skip(f"smollm2 not available: {exc}")
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
