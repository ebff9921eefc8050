"""Bytes a decode step reads per layer: what trades against answers kept.

Counted per layer over every KV head, for one decode row over n cached keys: the K of every key
whose K the step reads (full: all; the oracle: all, it ranks by exact attention; a selector: its
`search_reads` candidates plus the sinks and recent window), the V of the keys it attends, and
the method's own tables it reads (`index_read_bytes`: CSAttention's int8 rows). K/V at 2 bytes
(fp16 / bf16, what a GPU reads). `per_key`: bytes over n and KV heads; `x_dense`: over full
attention's K and V of every key.
"""

from __future__ import annotations

from ctxcache.methods import Budget, make_method

KV_BYTES = 2


def step_bytes(name: str, params: dict, n: int, budget: Budget, n_kv_heads: int, group: int,
               head_dim: int) -> dict[str, float]:
    """Bytes read per step and layer by method `name` (params) over n cached keys; `full` is dense."""
    lo, hi = budget.region(n)
    static, k = n - (hi - lo), min(budget.top_k(n), hi - lo)
    rows = 0
    if name == "full":
        k_keys = v_keys = n
    else:
        method = make_method(name, params)
        v_keys = method.attend_reads(k, hi - lo) + static
        k_keys = n if method.caps.reads_all_keys else method.search_reads(k, hi - lo) + static
        rows = method.index_read_bytes(n, n_kv_heads, group)
    k_b, v_b = (n_kv_heads * x * head_dim * KV_BYTES for x in (k_keys, v_keys))
    total = k_b + v_b + rows
    return {"k_bytes": k_b, "v_bytes": v_b, "index_bytes": rows, "total": total,
            "per_key": total / (n * n_kv_heads), "x_dense": total / (2 * n * n_kv_heads * head_dim * KV_BYTES)}
