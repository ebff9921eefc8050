"""GPU tables stacked for a batch: rows of several artifacts (stack_tables), every layer's rows
as views of one allocation (layer_tables), every layer's per-row step state as one tensor a field (carried_views)."""

from __future__ import annotations

import torch

from ctxcache.decoder.gpu.tables import GpuDenseTables, GpuTables


CARRIED = ("follow_prev", "chosen_prev", "reselect_left")  # GpuDenseTables' per-row step state


def layer_tables(layers: int, rows: int, like: dict[str, torch.Tensor], n_max: int, max_new: int,
                 device: torch.device | str, follow: int = 0, chosen: int = 0
                 ) -> tuple[list[GpuDenseTables], GpuDenseTables]:
    """`layers` layers' GpuDenseTables.empty of `rows` rows, views of one of layers x rows rows
    (returned second): layer l's row r is its row l x rows + r, so a row's state in every layer
    is one strided slice, `row_of_every_layer`: a hot admission's reset is a launch a field, not
    a launch a field and layer (with its slot caches', SlotCache.layers: ~260 launches at 32
    layers, ~25 us each on the H200's host). Its CARRIED state viewed [layers, rows, ...] is
    SlotRows.carried_rows (`carried_views`)."""
    whole = GpuDenseTables.empty(layers * rows, like, n_max, max_new, device, follow, chosen)
    return [whole.rows(i * rows, (i + 1) * rows) for i in range(layers)], whole


def carried_views(whole: GpuDenseTables, layers: int) -> tuple[torch.Tensor, ...]:
    """layer_tables' CARRIED state (those the tables hold) as [layers, rows, ...] views."""
    return tuple(getattr(whole, name).view(layers, -1, *getattr(whole, name).shape[1:]) for name in CARRIED
                 if getattr(whole, name) is not None)


def row_of_every_layer(row: int, rows: int) -> slice:
    """Row `row` of every layer in a table (or SlotCache) stacked by layer_tables."""
    return slice(row, None, rows)


def stack_tables(per_row: list[dict[str, torch.Tensor]], n_ctx: list[int], max_new: int,
                 device: torch.device | str, score_dtype: str = "float16") -> "GpuTables | GpuDenseTables":
    """GPU tables of whichever layout the artifact holds (dense_score: the dense layout)."""
    if all("dense_score" in t for t in per_row):
        return GpuDenseTables.stack(per_row, n_ctx, max_new, device, score_dtype)
    if any("dense_score" in t for t in per_row):
        raise ValueError("rows mix the dense and the list table layouts")
    return GpuTables.stack(per_row, n_ctx, max_new, device)
