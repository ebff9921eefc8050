"""CSAttention's dense rows, derived at load from what the artifact stores.

A dense row is one centroid's dot products with the keys of its subspace, `c . K_b`: it holds
nothing beyond the centroids and the keys, so the artifact stores the centroids [Hkv, m, C,
d_b] (1.6% of the K/V at SmolLM2 shapes) and the decoder derives the rows on its own device:
one batched matmul per layer (summed in fp64, so every device derives the same rows), then
int8 rows with a per-row scale where the parameters store int8 (methods/int8_tables).
Stored, the rows were 4x the K/V at head_dim 64 (int8) and 2x at 128.
"""

from __future__ import annotations

import torch

from ctxcache.methods.int8_tables import quantize_rows

DERIVED = ("dense_score", "dense_scale", "row_keys")  # what restore derives; never stored (format 2)
ROW_KEYS = "row_keys"  # restore on_demand: the subspace keys, fp64 [Hkv, m, d_b, N], the rows come from
# centroids scored at once: bounds the fp64 scratch (0.5 GB for a 120K-token layer at
# Llama-3.1-8B shapes, where all 128 at once in fp32 were 3.9 GB beside a GPU runner's full
# table buffer). The fp64 sums make the rows independent of the block (and of the device).
_CENTROID_BLOCK = 8


def dense_rows(centroids: torch.Tensor, sub_k: torch.Tensor, int8: bool) -> dict[str, torch.Tensor]:
    """Tables from centroids [Hkv, m, C, d_b] and subspace keys sub_k [Hkv, m, N, d_b] (any
    dtype, on the decoding device) -> {"centroids", "dense_score" [Hkv, m, C, N] fp16 or int8,
    and "dense_scale" [Hkv, m, C] fp32 when int8}."""
    if centroids.shape[:2] != sub_k.shape[:2] or centroids.shape[-1] != sub_k.shape[-1]:
        raise ValueError(f"centroids {tuple(centroids.shape)} and subspace keys {tuple(sub_k.shape)} "
                         "disagree in heads, subspaces or subspace width")
    # fp64: a product of fp16 (or bf16) values is exact there and so, in practice, is a sum
    # of d_b of them, so every device, block and matmul shape yields the same rows (the CPU's
    # routed rows, the GPU's materialized ones)
    if int8 and sub_k.is_cuda:
        from ctxcache.kernels.load_kernels import int8_rows, rows_ok

        if rows_ok(centroids, sub_k):  # one pass, the same bits (an fp64 key copy and GEMM took 77 ms at 32K)
            rows_i8, scales_f = int8_rows(centroids, sub_k)
            return {"centroids": centroids, "dense_score": rows_i8, "dense_scale": scales_f}
    hkv, m, c, _ = centroids.shape
    n = sub_k.shape[2]
    rows = torch.empty(hkv, m, c, n, dtype=torch.int8 if int8 else torch.float16, device=sub_k.device)
    scales = torch.empty(hkv, m, c, dtype=torch.float32, device=sub_k.device) if int8 else None
    keys_t = row_keys(sub_k)  # once per layer, not per block
    block = _CENTROID_BLOCK
    for lo in range(0, c, block):
        scores = row_scores(centroids[:, :, lo:lo + block], keys_t)  # [Hkv, m, b, N] fp16
        if int8:
            rows[:, :, lo:lo + block], scales[:, :, lo:lo + block] = quantize_rows(scores)
        else:
            rows[:, :, lo:lo + block] = scores
    tables = {"centroids": centroids, "dense_score": rows}
    return {**tables, "dense_scale": scales} if int8 else tables


def row_keys(sub_k: torch.Tensor) -> torch.Tensor:
    """Subspace keys [..., N, d_b] as the rows are scored against them: fp64 [..., d_b, N]."""
    # one strided pass: converting, then making the transpose contiguous wrote the keys twice
    out = torch.empty((*sub_k.shape[:-2], sub_k.shape[-1], sub_k.shape[-2]), dtype=torch.float64, device=sub_k.device)
    return out.copy_(sub_k.transpose(-1, -2))


def row_scores(centroids: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
    """fp16 rows [..., R, N] = centroids [..., R, d_b] . keys (row_keys), summed in fp64."""
    return torch.matmul(centroids.double(), keys_t).half()


def routed_rows(chosen: torch.Tensor, keys_t: torch.Tensor, int8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of the chosen centroids [Hkv, G, m, tau, d_b] over the subspace keys as restore
    keeps them (ROW_KEYS: fp64 [Hkv, m, d_b, N]) -> (rows [Hkv, G*m*tau, N], per-row scales
    [Hkv, G*m*tau] when int8): bitwise the rows dense_rows materializes for the same centroids."""
    hkv, g, m, tau, d = chosen.shape
    cent = chosen.permute(0, 2, 1, 3, 4).reshape(hkv, m, g * tau, d)
    rows = row_scores(cent, keys_t)  # [Hkv, m, G*tau, N]
    rows = rows.view(hkv, m, g, tau, -1).permute(0, 2, 1, 3, 4).reshape(hkv, g * m * tau, -1)
    if not int8:
        return rows, None
    return quantize_rows(rows)


def dense_row_bytes(n_tokens: int, n_kv_heads: int, subspaces: int, centroids: int, int8: bool) -> int:
    """Bytes of one layer's derived rows (and their scales) for n_tokens keys."""
    rows = n_kv_heads * subspaces * centroids
    return rows * n_tokens * (1 if int8 else 2) + (rows * 4 if int8 else 0)
