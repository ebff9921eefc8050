"""CSAttention's dense rows, derived at load from what the artifact stores.

A dense row is one centroid's dot products with the keys of its subspace, `c . K_b`: it holds
nothing beyond the centroids and the keys, so the artifact stores the centroids [Hkv, m, C,
d_b] (1.6% of the K/V at SmolLM2 shapes) and the decoder derives the rows on its own device:
one batched matmul per layer (fp32, so the CPU and the GPU round the same products), then
int8 rows with a per-row scale where the parameters store int8 (methods/int8_tables).
Stored, the rows were 4x the K/V at head_dim 64 (int8) and 2x at 128.
"""

from __future__ import annotations

import torch

from ctxcache.methods.int8_tables import quantize_rows

DERIVED = ("dense_score", "dense_scale")  # what restore derives; never stored (format 2)
# centroids scored at once: bounds the fp32 scratch (0.5 GB for a 120K-token layer at
# Llama-3.1-8B shapes, where all 128 at once were 3.9 GB beside a GPU runner's full table
# buffer). Fixed, not sized from memory: the block changes the matmul's rounding, and the
# build and every load must derive the same rows.
_CENTROID_BLOCK = 16


def dense_rows(centroids: torch.Tensor, sub_k: torch.Tensor, int8: bool) -> dict[str, torch.Tensor]:
    """Tables from centroids [Hkv, m, C, d_b] and subspace keys sub_k [Hkv, m, N, d_b] (any
    dtype, on the decoding device) -> {"centroids", "dense_score" [Hkv, m, C, N] fp16 or int8,
    and "dense_scale" [Hkv, m, C] fp32 when int8}."""
    if centroids.shape[:2] != sub_k.shape[:2] or centroids.shape[-1] != sub_k.shape[-1]:
        raise ValueError(f"centroids {tuple(centroids.shape)} and subspace keys {tuple(sub_k.shape)} "
                         "disagree in heads, subspaces or subspace width")
    hkv, m, c, _ = centroids.shape
    n = sub_k.shape[2]
    keys_t = sub_k.float().transpose(-1, -2)
    rows = torch.empty(hkv, m, c, n, dtype=torch.int8 if int8 else torch.float16, device=sub_k.device)
    scales = torch.empty(hkv, m, c, dtype=torch.float32, device=sub_k.device) if int8 else None
    block = _CENTROID_BLOCK
    for lo in range(0, c, block):
        scores = torch.matmul(centroids[:, :, lo:lo + block].float(), keys_t).half()  # [Hkv, m, b, N]
        if int8:
            rows[:, :, lo:lo + block], scales[:, :, lo:lo + block] = quantize_rows(scores)
        else:
            rows[:, :, lo:lo + block] = scores
    tables = {"centroids": centroids, "dense_score": rows}
    return {**tables, "dense_scale": scales} if int8 else tables


def dense_row_bytes(n_tokens: int, n_kv_heads: int, subspaces: int, centroids: int, int8: bool) -> int:
    """Bytes of one layer's derived rows (and their scales) for n_tokens keys."""
    rows = n_kv_heads * subspaces * centroids
    return rows * n_tokens * (1 if int8 else 2) + (rows * 4 if int8 else 0)
