"""Per-stream constants of CSAttention's CPU decode, converted once instead of every step.

A decode step at 4K tokens on the CPU is dominated by torch call overhead, not arithmetic: the
general estimate converted the centroids to fp32 (and the routed ones to fp64) and built index
grids in every layer of every step. LeanState holds them per LayerState (per stream and layer);
it is derived from the tables alone, so results are unchanged bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxcache.methods.base import LayerState
from ctxcache.methods.int8_tables import quantized_row_values

_KEY = "lean"  # LayerState.extra key


@dataclass(frozen=True)
class LeanState:
    cent: torch.Tensor  # centroids [Hkv, m, C, d_b] fp32 (routing, streamed scores)
    cent64: torch.Tensor  # the same, fp64, flattened [Hkv * m * C, d_b] (the routed rows' matmul)
    hh: torch.Tensor  # [Hkv, 1, 1, 1] head index grid
    mm: torch.Tensor  # [1, 1, m, 1] subspace index grid

    def routed_rows(self, ids: torch.Tensor, keys_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """csattention_rows.routed_rows for one route per group and subspace (ids [Hkv, 1, m, 1]),
        its rows as the int8 values in fp32 [Hkv, m, N] and their scales [Hkv, m]: the same fp64
        matmul on the same shapes, so the same rows bit for bit."""
        hkv, m, c, d = self.cent.shape
        flat = ((self.hh * m + self.mm) * c + ids).flatten()
        chosen = self.cent64.index_select(0, flat).view(hkv, m, 1, d)
        rows = torch.matmul(chosen, keys_t).half().view(hkv, m, -1)  # summed in fp64 (row_scores)
        return quantized_row_values(rows)


def lean_state(state: LayerState) -> LeanState:
    """The stream's LeanState for this layer, made at its first use."""
    lean = state.extra.get(_KEY)
    if lean is None:
        cent = state.tables["centroids"].float()
        hkv, m = cent.shape[:2]
        lean = LeanState(cent, cent.double().flatten(0, 2), torch.arange(hkv, device=cent.device)[:, None, None, None],
                         torch.arange(m, device=cent.device)[None, None, :, None])
        state.extra[_KEY] = lean
    return lean
