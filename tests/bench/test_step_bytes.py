"""Bytes a step reads: what trades against answers kept in bench compare's retention table."""

from __future__ import annotations

import pytest

from ctxcache.quality.step_bytes import step_bytes
from ctxcache.methods import Budget, make_method

SMOLLM2 = {"n_kv_heads": 3, "group": 3, "head_dim": 64}


def test_csattention_reads_its_candidates_k_its_rows_and_the_budget_v():
    n, budget = 4096, Budget(0.05, 4, 32)
    got = step_bytes("csattention", {"reselect": 1}, n, budget, **SMOLLM2)
    k, static = budget.top_k(n), 36
    assert got["k_bytes"] == 3 * (4 * k + static) * 64 * 2  # rerank 4 (the default): the candidates' K
    # reselect 2 (the default): the mean of a selecting step's and a carried step's (K + follow + 1)
    carried = step_bytes("csattention", {}, n, budget, **SMOLLM2)
    assert carried["k_bytes"] == 3 * (-(-(4 * k + k + 129) // 2) + static) * 64 * 2
    assert carried["v_bytes"] == 3 * (-(-(k + k + 129) // 2) + static) * 64 * 2  # a carried step attends them all
    assert carried["index_bytes"] == 3 * 16 * (n + 4) // 2  # the estimate's rows on selecting steps only
    assert got["v_bytes"] == 3 * (k + static) * 64 * 2
    assert got["index_bytes"] == 3 * 16 * (n + 4)  # 16 routed int8 rows and their fp32 scales
    assert got["per_key"] == pytest.approx(got["total"] / (3 * n))
    assert step_bytes("full", {}, n, budget, **SMOLLM2)["x_dense"] == 1.0
    oracle = step_bytes("oracle", {}, n, budget, **SMOLLM2)
    assert oracle["k_bytes"] == 3 * n * 64 * 2 and oracle["index_bytes"] == 0


def test_index_bytes_follow_routing_and_storage():
    rows = make_method("csattention").index_read_bytes(1000, 2, 4)
    assert make_method("csattention", {"routing": "head"}).index_read_bytes(1000, 2, 4) == 4 * rows
    fp16 = make_method("csattention", {"table_dtype": "float16", "reselect": 1})
    assert fp16.index_read_bytes(1000, 2, 4) == 2 * 16 * 1000 * 2
    assert make_method("quest").index_read_bytes(1000, 2, 4) == 0  # not counted for other methods
