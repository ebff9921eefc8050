"""int8 dense tables (CSAttention table_dtype="int8"): the quantization and the integer score.

The dense layout stores every key's score against every centroid: at Llama-3.1-8B shapes that
is 4x the KV bytes in fp16, and streaming the routed rows is most of a decode step's selection.
int8 rows with a per-row scale halve both. The estimate is then an integer dot product: the
routed weights (times each row's scale) are quantized too, with one power-of-two scale per KV
head, so every product and sum is exact and the GPU kernel (kernels/dense_dot8, dp4a) computes
bitwise the same scores as this torch code. Pure torch: the CPU method and the kernel tests
share it.
"""

from __future__ import annotations

from typing import Callable

import torch


def quantize_rows(dense: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 dense_score [..., N] -> (int8 [..., N], scale [...] fp32), symmetric per row, values
    in [-L, L] with L = 2^(bits-1) - 1 (127 for 8 bits; fewer bits: the same int8 arithmetic on
    coarser values, what `bench footprint` measures 4-bit rows with)."""
    q, scale = quantized_row_values(dense, bits)
    return q.to(torch.int8), scale


def quantized_row_values(dense: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows' integers as fp32 (exactly the int8 values; int_dot_scores multiplies them
    as fp32): the CPU decode scores each step's routed rows straight from these, two passes over
    the rows fewer than through int8 and back."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits={bits} must be in [2, 8]")
    levels = float(2 ** (bits - 1) - 1)
    values = dense.float()
    scale = values.abs().amax(-1).clamp_min(1e-8) / levels
    if values.data_ptr() == dense.data_ptr():  # already fp32: the caller's tensor, do not write it
        values = values.clone()
    return values.div_(scale[..., None]).round_().clamp_(-levels, levels), scale


def int8_dense_tables(tables: dict[str, torch.Tensor],
                      quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_rows
                      ) -> dict[str, torch.Tensor]:
    """Dense tables with fp16 dense_score as CSAttention stores them with table_dtype="int8":
    int8 rows plus "dense_scale" (tables already int8 are returned as they are). quantize:
    quantize_rows, or an implementation with its exact results (the GPU build's kernel)."""
    if "dense_scale" in tables:
        return tables
    dense, scale = quantize(tables["dense_score"])
    return {**tables, "dense_score": dense, "dense_scale": scale}


def weight_scale(ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^-e, 2^e) per row set from max |ws| over the last dim, read from the fp32 exponent bits
    so that max |ws| * 2^-e lies in [64, 128); sets whose largest weight is below 2^-120 get
    (0, 0) (all their weights quantize to 0)."""
    big = ws.abs().amax(-1).float().view(torch.int32)
    e_bits = (big >> 23) & 0xFF
    ok = e_bits >= 7
    inv = torch.where(ok, (260 - e_bits) << 23, 0).view(torch.float32)
    deq = torch.where(ok, (e_bits - 6) << 23, 0).view(torch.float32)
    return inv, deq


def quantize_weights(ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weights [..., R] -> (integer-valued fp32 weights in [-127, 127], 2^e [...]): exact
    arithmetic (a power-of-two scale, floor(x + 0.5)), so every implementation agrees bitwise."""
    inv, deq = weight_scale(ws)
    return torch.floor(ws.float() * inv[..., None] + 0.5).clamp(-127, 127), deq


def int_dot_scores(rows: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """Scores [..., N] = 2^e * sum_r wq_r * rows[..., r, N] for int8 rows [..., R, N] and their
    weights ws [..., R] (routed weight x row scale). The fp32 matmul is exact: integers below
    2^24 (R * 127 * 127 for R <= 1040)."""
    if rows.shape[-2] * 127 * 127 >= 1 << 24:
        raise ValueError(f"{rows.shape[-2]} rows: the integer sum could exceed fp32's exact range")
    wq, deq = quantize_weights(ws)
    isum = (wq.unsqueeze(-2) @ rows.float()).squeeze(-2)
    return isum * deq[..., None]
