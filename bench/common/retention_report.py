"""The answer-retention part of `bench compare --merge`: per method the fraction of full
attention's right answers kept, overall, per kind of document and by slice, with the bytes a
step reads beside it (bench/common/step_bytes.py); a table and two plot panels."""

from __future__ import annotations

from ctxcache.bench.common.copy_tasks import DEPTHS, QKINDS
from ctxcache.bench.common.retention import ORACLE, retention

FULL = "full"
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
    from ctxcache.bench.common import wide_report  # here: wide_report imports this module
    if wide_report.is_wide(config):
        return wide_report.summarize_wide(ret, label, keep, config)
    out = retention(ret, label, keep)
    out["slices"] = {name: retention(ret, label, keep, where=f)["kept"]
                     for name, f in retention_slices(config).items()}
    out["by_kind"] = {}
    for kind in (config.get("retention") or {}).get("fillers", []):
        def where(r: dict, kind: str = kind) -> bool:
            return r["filler"] == kind
        mine = retention(ret, label, keep, where=where)
        mine["oracle_kept"] = retention(ret, ORACLE, keep, where=where)["kept"]
        out["by_kind"][kind] = mine
    return out


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _cell(r: dict, part: dict) -> str:
    """kept (of how many), and against the oracle W / L and p."""
    head = f"{_f(part['kept'])} ({part['full_correct']})"
    if r["method"] in (FULL, ORACLE):
        return head
    return f"{head} {part['vs_oracle_wins']}/{part['vs_oracle_losses']} p={_f(part['sign_test_p'], '.2g')}"


def retention_markdown(rows: list[dict], config: dict) -> str:
    """Retention per kind of document (with bytes read per step) and by slice."""
    from ctxcache.bench.common import wide_report  # here: wide_report imports this module
    if wide_report.is_wide(config):
        return wide_report.wide_markdown(rows, config)
    rows = [r for r in rows if r["method"] != FULL]
    if not rows:
        return ""
    kinds = (config.get("retention") or {}).get("fillers", [])
    head = ["method", "keep", "B/key read (x dense)", "all"] + kinds
    lines = ["", "Answer retention by kind of document: kept of full attention's right answers (how many), "
             "W/L against the oracle at the same keep, two-sided sign test p:", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ret = r["retention"]
        read, frac = ret.get("read_per_key"), ret.get("read_x_dense")
        read_cell = "-" if read is None else f"{read:.1f} ({frac:.3f})"
        cells = [r["method"], _f(r["keep"], ".2f"), read_cell, _cell(r, ret)]
        cells += [_cell(r, ret["by_kind"][k]) if k in ret.get("by_kind", {}) else "-" for k in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    n = max(r["retention"]["questions"] for r in rows)
    notes = [
        f"{n} questions per method over {len(kinds)} kinds of document (bench/texts/README.md): numbers, "
        "ticket numbers and cities at 10 / 25 / 50 / 75 / 90% depth, four locker numbers under one template "
        "(multikey), a two-value key, document lines to finish; `kept` counts only the questions full "
        "attention answers exactly.",
        "B/key read: bytes a decode step reads per layer over the cached keys and KV heads, divided by their "
        "number (mean over the contexts): K of every key whose K it reads (the oracle: all; csattention: its "
        "re-rank candidates, sinks and recent), V of the keys attended, the index rows it reads (int8); "
        "K/V at 2 bytes. x dense: over full attention's K and V.",
    ]
    names = list(retention_slices(config))
    lines += ["", *(f"- {x}" for x in notes), "", "Retention by slice (fraction of full attention's correct answers kept):",
              "", "| method | keep | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 2)]
    for r in rows:
        sl = r["retention"]["slices"]
        lines.append(f"| {r['method']} | {_f(r['keep'], '.2f')} | " + " | ".join(_f(sl.get(x)) for x in names) + " |")
    return "\n".join(lines) + "\n"


def draw_retention(axes: list, rows: list[dict], config: dict) -> None:
    """axes[0]: kept per kind of document, one bar per method; axes[1]: kept vs bytes read."""
    kinds = (config.get("retention") or {}).get("fillers", [])
    ax = axes[0]
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        vals = [r["retention"].get("by_kind", {}).get(k, {}).get("kept") or 0.0 for k in kinds]
        vals.append(r["retention"]["kept"] or 0.0)
        ax.bar([j + i * width for j in range(len(kinds) + 1)], vals, width, label=f"{r['method']} {_f(r['keep'], '.2f')}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds) + 1)], [*kinds, "all"], rotation=30, fontsize=7)
    ax.set_ylim(0.5, 1.02)
    ax.set(title="answers kept, by kind of document", ylabel="fraction of full's right answers kept")
    ax.legend(fontsize=6, loc="lower left")
    ax = axes[1]
    for r in rows:
        x, y = r["retention"].get("read_per_key"), r["retention"]["kept"]
        if x is None or y is None:
            continue
        ax.plot([x], [y], "o")
        ax.annotate(r["method"], (x, y), fontsize=6)
    ax.set(title="answers kept vs bytes read per step", xlabel="bytes read per cached key and KV head (layer)",
           ylabel="fraction of full's right answers kept")
