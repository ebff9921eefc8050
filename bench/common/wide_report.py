"""The wide retention suite's part of `bench compare --merge`: kept of full attention's right
answers per kind of document, per needle depth and per question kind, each cell with its
paired sign test against the oracle (exact group top-K at the same keep), and per kind x depth.

Issue 45 asks that a loss of 2 points be visible in all and that no kind fall more than 0.05
below the oracle: so every cell keeps its counts (full_correct, wins, losses), not only the
fraction, and cells from different shards are recomputed from the merged rows, never averaged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ctxcache.bench.common.retention import ORACLE, retention
from ctxcache.bench.common.retention_report import FULL, _cell, _f
from ctxcache.bench.common.wide_tasks import WIDE_DEPTHS, WIDE_QKINDS

Where = Callable[[dict], bool]


def is_wide(config: dict) -> bool:
    return (config.get("retention") or {}).get("suite") == "wide"


def _kinds(config: dict) -> list[str]:
    return (config.get("retention") or {}).get("fillers", [])


def _axes(config: dict) -> dict[str, dict[str, Where]]:
    """Axis -> cell name -> row filter: kind of document, needle depth, question kind."""
    return {
        "by_kind": {k: (lambda k: lambda r: r["filler"] == k)(k) for k in _kinds(config)},
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
            for d in WIDE_DEPTHS} for k in _kinds(config)}
    return out


def _counts(part: dict) -> dict[str, Any]:
    return {k: part[k] for k in ("kept", "full_correct", "vs_oracle_wins", "vs_oracle_losses")}


def _table(rows: list[dict], axis: str, names: list[str], title: str) -> list[str]:
    head = ["method", "keep", "all", *names]
    lines = ["", title, "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ret = r["retention"]
        cells = [r["method"], _f(r["keep"], ".2f"), _cell(r, ret)]
        cells += [_cell(r, ret[axis][n]) if n in ret.get(axis, {}) else "-" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def wide_markdown(rows: list[dict], config: dict) -> str:
    """Tables by kind of document, by depth, by question kind; bytes read per step."""
    rows = [r for r in rows if r["method"] != FULL]
    if not rows:
        return ""
    how = ("kept of full attention's right answers (how many), W/L against the oracle (exact group "
           "top-K at the same keep), two-sided sign test p")
    lines = _table(rows, "by_kind", _kinds(config), f"Wide suite, by kind of document: {how}:")
    lines += _table(rows, "by_depth", [str(d) for d in WIDE_DEPTHS], "Wide suite, by needle depth (fraction of the context):")
    lines += _table(rows, "by_qkind", list(WIDE_QKINDS), "Wide suite, by question kind:")
    reads = [f"{r['method']} {_f(r['retention'].get('read_per_key'), '.1f')} B "
             f"({_f(r['retention'].get('read_x_dense'))} x dense)" for r in rows]
    n = max(r["retention"]["questions"] for r in rows)
    notes = [f"{n} questions per method; per context, at each depth (5 / 10 / 25 / 50 / 75%): a number, a version "
             "and a name in the document's own shape, one of five people's values under one template (multikey), "
             "a document line to finish (doc). Texts and licenses: bench/texts/README.md.",
             "Bytes read per cached key and KV head per step (layer): " + ", ".join(reads) + "."]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {x}" for x in notes) + "\n"
