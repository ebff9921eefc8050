"""The retention suites' cells (`bench compare --merge` renders them; tests check them across
shards). Bundled: kept of full attention's right answers overall, per kind of document beside the
oracle's (exact group top-K at the same keep), and by slice (length, question kind, depth, kind).
Wide: per kind of document, per needle depth and per question kind, each with its paired sign test
against the oracle, and per kind x depth.

Issue 45 asks that a loss of 2 points be visible in all and that no kind fall more than 0.05
below the oracle: so every cell keeps its counts (full_correct, wins, losses), not only the
fraction, and cells from different shards are recomputed from the merged rows, never averaged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ctxcache.quality.copy_tasks import DEPTHS, QKINDS
from ctxcache.quality.retention import ORACLE, retention
from ctxcache.quality.wide_tasks import WIDE_DEPTHS, WIDE_QKINDS

Where = Callable[[dict], bool]


def is_wide(config: dict) -> bool:
    return (config.get("retention") or {}).get("suite") == "wide"


def kinds(config: dict) -> list[str]:
    return (config.get("retention") or {}).get("fillers", [])


def _axes(config: dict) -> dict[str, dict[str, Where]]:
    """Axis -> cell name -> row filter: kind of document, needle depth, question kind."""
    return {
        "by_kind": {k: (lambda k: lambda r: r["filler"] == k)(k) for k in kinds(config)},
        "by_depth": {str(d): (lambda d: lambda r: r["depth"] == d)(d) for d in WIDE_DEPTHS},
        "by_qkind": {q: (lambda q: lambda r: r["qkind"] == q)(q) for q in WIDE_QKINDS},
    }


def _with_oracle(ret: list[dict], label: str, keep: float | None, where: Where) -> dict[str, Any]:
    mine = retention(ret, label, keep, where=where)
    mine["oracle_kept"] = retention(ret, ORACLE, keep, where=where)["kept"]
    return mine


def summarize_wide(ret: list[dict], label: str, keep: float | None, config: dict) -> dict[str, Any]:
    """Overall retention; per kind, depth and question kind the same with the oracle's fraction
    beside it; per kind x depth the counts alone; `slices` (kept by cell) for the plot."""
    out = retention(ret, label, keep)
    slices: dict[str, float | None] = {}
    for axis, cells in _axes(config).items():
        out[axis] = {name: _with_oracle(ret, label, keep, f) for name, f in cells.items()}
        slices.update({f"{axis[3:]} {name}": v["kept"] for name, v in out[axis].items()})
    out["slices"] = slices
    out["by_kind_depth"] = {
        k: {str(d): _counts(retention(ret, label, keep, where=lambda r, k=k, d=d: r["filler"] == k and r["depth"] == d))
            for d in WIDE_DEPTHS} for k in kinds(config)}
    return out


def _counts(part: dict) -> dict[str, Any]:
    return {k: part[k] for k in ("kept", "full_correct", "vs_oracle_wins", "vs_oracle_losses")}


SINGLE_NEEDLES = ("number", "ticket", "city")


def retention_slices(config: dict) -> dict:
    """Slice name -> row filter: context length, question kind, needle depth, kind of document."""
    ret = config.get("retention") or {}
    return {
        **{f"@{n}": (lambda n: lambda r: r["length"] == n)(n) for n in ret.get("lengths", [])},
        **{q: (lambda q: lambda r: r["qkind"] == q)(q) for q in QKINDS},
        **{f"depth {d}": (lambda d: lambda r: r["qkind"] in SINGLE_NEEDLES and r["depth"] == d)(d) for d in DEPTHS},
        **{f"in {f}": (lambda f: lambda r: r["filler"] == f)(f) for f in ret.get("fillers", [])},
    }


def summarize_retention(ret: list[dict], label: str, keep: float | None, config: dict) -> dict:
    """Overall retention against full and the oracle; per kind of document the same with the
    oracle's fraction beside it; the fraction kept by slice. The wide suite has its own cells."""
    if is_wide(config):
        return summarize_wide(ret, label, keep, config)
    out = retention(ret, label, keep)
    out["slices"] = {name: retention(ret, label, keep, where=f)["kept"]
                     for name, f in retention_slices(config).items()}
    out["by_kind"] = {k: _with_oracle(ret, label, keep, lambda r, k=k: r["filler"] == k) for k in kinds(config)}
    return out
