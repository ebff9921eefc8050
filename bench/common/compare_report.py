"""The report of `bench compare --merge` (bench/compare.py, its one user; apart for its size):
the merged shards summarized per (method, keep) into a Markdown table and PNG plots. Fidelity
per text and task accuracy; answer retention: per method the fraction of full attention's right
answers kept, overall, per kind of document and by slice, with the bytes a step reads beside it
(quality/step_bytes.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ctxcache.quality.retention import ORACLE
from ctxcache.quality.retention_cells import is_wide, kinds, retention_slices, summarize_retention
from ctxcache.quality.wide_tasks import WIDE_DEPTHS, WIDE_QKINDS

FULL = "full"
def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _wl(part: dict, sep: str = "/") -> str:
    """W / L against the oracle, "-" where the run had no oracle to count against."""
    if part["vs_oracle_wins"] is None:
        return "-"
    return f"{part['vs_oracle_wins']}{sep}{part['vs_oracle_losses']}"


def _cell(r: dict, part: dict) -> str:
    """kept (of how many), and against the oracle W / L and p."""
    head = f"{_f(part['kept'])} ({part['full_correct']})"
    if r["method"] in (FULL, ORACLE):
        return head
    if part["vs_oracle_wins"] is None:
        return f"{head} -"
    return f"{head} {_wl(part)} p={_f(part['sign_test_p'], '.2g')}"


def retention_markdown(rows: list[dict], config: dict) -> str:
    """Retention per kind of document (with bytes read per step) and by slice."""
    if is_wide(config):
        return wide_markdown(rows, config)
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
        f"{n} questions per method over {len(kinds)} kinds of document (quality/corpus/README.md): numbers, "
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


def _wide_table(rows: list[dict], axis: str, names: list[str], title: str) -> list[str]:
    head = ["method", "keep", "all", *names]
    lines = ["", title, "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ret = r["retention"]
        cells = [r["method"], _f(r["keep"], ".2f"), _cell(r, ret)]
        cells += [_cell(r, ret[axis][n]) if n in ret.get(axis, {}) else "-" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _kind_depth_tables(rows: list[dict], config: dict) -> list[str]:
    """Per method (not the oracle): kind x depth, its kept beside the oracle's at the same keep,
    full attention's right answers and W/L: where a loss sits, not only that it exists."""
    depths = [str(d) for d in WIDE_DEPTHS]
    lines: list[str] = []
    for r in rows:
        cells = r["retention"].get("by_kind_depth")
        if r["method"] == ORACLE or not cells:
            continue
        ref = next((o["retention"].get("by_kind_depth", {}) for o in rows
                    if o["method"] == ORACLE and o["keep"] == r["keep"]), {})
        lines += ["", f"Wide suite, kind x depth: {r['method']} / oracle kept at keep {_f(r['keep'], '.2f')} "
                  "(full attention's right answers) W/L:", "",
                  "| kind | " + " | ".join(depths) + " |", "|" + " --- |" * (len(depths) + 1)]
        for k in kinds(config):
            row = [k]
            for d in depths:
                c, o = cells.get(k, {}).get(d), ref.get(k, {}).get(d)
                row.append("-" if c is None else f"{_f(c['kept'])} / {_f(o['kept'] if o else None)} "
                           f"({c['full_correct']}) {_wl(c)}")
            lines.append("| " + " | ".join(row) + " |")
    return lines


def wide_markdown(rows: list[dict], config: dict) -> str:
    """Tables by kind of document, by depth, by question kind; bytes read per step."""
    rows = [r for r in rows if r["method"] != FULL]
    if not rows:
        return ""
    how = ("kept of full attention's right answers (how many), W/L against the oracle (exact group "
           "top-K at the same keep), two-sided sign test p")
    lines = _wide_table(rows, "by_kind", kinds(config), f"Wide suite, by kind of document: {how}:")
    lines += _wide_table(rows, "by_depth", [str(d) for d in WIDE_DEPTHS], "Wide suite, by needle depth (fraction of the context):")
    lines += _wide_table(rows, "by_qkind", list(WIDE_QKINDS), "Wide suite, by question kind:")
    lines += _kind_depth_tables(rows, config)
    reads = [f"{r['method']} {_f(r['retention'].get('read_per_key'), '.1f')} B "
             f"({_f(r['retention'].get('read_x_dense'))} x dense)" for r in rows]
    n = max(r["retention"]["questions"] for r in rows)
    notes = [f"{n} questions per method; per context, at each depth (5 / 10 / 25 / 50 / 75%): a number, a version "
             "and a name in the document's own shape, one of five people's values under one template (multikey), "
             "a document line to finish (doc). Texts and licenses: quality/corpus/README.md.",
             "Bytes read per cached key and KV head per step (layer): " + ", ".join(reads) + "."]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {x}" for x in notes) + "\n"


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


# fidelity and tasks, and the whole table and figure


def load_shards(folder: Path) -> dict:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no shard JSON in {folder}")
    shards = [json.loads(f.read_text()) for f in files]
    config = shards[0]["config"]
    for f, s in zip(files, shards):
        if s.get("bench") != "compare" or s["config"] != config:
            raise ValueError(f"{f} is not a compare shard of the same configuration as {files[0]}")
    cells: dict = {}
    for s in shards:
        cells.update(s["cells"])
    cpus = {s["machine"].get("cpu") for s in shards}
    if len(cpus) > 1:
        raise ValueError(f"shards come from different machines {sorted(map(str, cpus))}")
    commits = sorted({str(c.get("commit", s.get("commit"))) for s in shards for c in s["cells"].values()})
    return {"config": config, "machine": shards[0]["machine"], "date": max(s["date"] for s in shards),
            "commit": commits[0] if len(commits) == 1 else commits,
            "cells": cells, "shard_files": [f.name for f in files]}


def summarize(merged: dict, specs: list) -> list[dict]:
    """One row per (method, keep) of specs (compare.method_specs): fidelity per text, task
    accuracy per task and overall."""
    config, cells = merged["config"], merged["cells"]
    fid = [r for c in cells.values() for r in c["rows"] if r["kind"] == "fidelity"]
    tasks = [r for c in cells.values() for r in c["rows"] if r["kind"] == "task"]
    ret = [r for c in cells.values() for r in c["rows"] if r["kind"] == "retention"]
    ret_keeps = (config.get("retention") or {}).get("keeps", [])
    rows = []
    for spec in specs:
        keeps = [None] if spec.name == FULL or spec.own_budget else sorted(set(config["keeps"]) | set(ret_keeps))
        for keep in keeps:
            row: dict = {"method": spec.label, "keep": keep, "params": spec.params}
            for r in fid:
                if r["method"] == spec.label and r["keep"] == keep:
                    row.setdefault("fidelity", {})[r["text"]] = {
                        k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                    for k in ("sampled_frac", "paper_table8"):
                        if k in r:
                            row[k] = r[k]
            mine = [r for r in tasks if r["method"] == spec.label and r["keep"] == keep]
            if mine:
                row["tasks"] = _task_means(mine)
            if any(r["method"] == spec.label and r["keep"] == keep for r in ret):
                row["retention"] = summarize_retention(ret, spec.label, keep, config)
            rows.append(row)
    return rows


def _task_means(rows: list[dict]) -> dict:
    """Mean score per (length, task) and over all tasks per length; trial counts."""
    out: dict = {}
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        per = {t: sum(r["score"] for r in at if r["task"] == t) / sum(1 for r in at if r["task"] == t)
               for t in sorted({r["task"] for r in at})}
        out[str(length)] = {"mean": sum(per.values()) / len(per), "per_task": per,
                            "trials": len(at), "n_tokens": sorted({r["n_tokens"] for r in at})}
    return out


def task_lengths(config: dict) -> list[str]:
    """The task suite's context lengths; none when its cells were skipped."""
    return [] if "task" in config.get("skip", []) else [str(n) for n in config["task_lengths"]]


def detail_length(config: dict) -> str:
    """The task length whose per-task scores the table spells out: the fidelity length if the
    suite ran there, else the first."""
    lengths = [str(n) for n in config["task_lengths"]]
    return str(config["tokens"]) if str(config["tokens"]) in lengths else lengths[0]


def markdown(merged: dict, rows: list[dict]) -> str:
    config, m = merged["config"], merged["machine"]
    texts, lengths = config["texts"], task_lengths(config)
    tasks, at = (config["tasks"] if lengths else []), detail_length(config)
    ret_rows = [r for r in rows if "retention" in r]
    missing = merged.get("missing_cells") or []
    if "fid" in config.get("skip", []) and not lengths:  # a retention run: its tables alone
        notes = [f"Model {config['model']}, sinks {config['sinks']} + recent {config['recent']} always read; "
                 f"machine: {m.get('cpu')} ({m.get('cpu_count')} CPUs), torch {m.get('torch')}; date {merged['date']}."]
        if missing:
            notes.append(f"INCOMPLETE: {len(missing)} cells missing: {', '.join(missing)}")
        return "\n".join(f"- {n}" for n in notes) + "\n" + retention_markdown(ret_rows, config)
    tl = "/".join(t[0].upper() for t in texts)
    head = (["method", "keep", "keys read"] + [f"mass recall {tl}", f"top-K recall {tl}",
             f"output rel. err. {tl}", f"top-1 agr. {tl}", f"NLL change {tl}"]
            + [f"tasks @{n}" for n in lengths] + [f"{t} @{at}" for t in tasks]
            + ["kept of full's right", "W/L vs oracle", "sign p"]
            + ["search us", f"build s ({texts[0]})"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        fid = r.get("fidelity", {})

        def per_text(key: str, fmt: str = ".3f", suffix: str = "") -> str:
            vals = [fid.get(t, {}).get(key) for t in texts]
            return " / ".join(_f(v, fmt) + (suffix if v is not None else "") for v in vals)
        first = fid.get(texts[0], {})
        if r["method"] == FULL:
            keep, read = "1", "1.000"
        elif "sampled_frac" in r:
            keep = f"K={r['params']['bits']}, L={r['params']['tables']}"
            read = f"{_f(r['sampled_frac'])} sampled (paper {_f(r.get('paper_table8'), '.3f')})"
        else:
            keep, read = f"{r['keep']:.2f}", per_text("keys_read_frac")
        task = r.get("tasks", {})
        cells = ([r["method"], keep, read, per_text("mass_recall"), per_text("topk_recall"),
                  per_text("output_rel_error"), per_text("top1_agreement"), per_text("nll_delta_pct", "+.2f", "%")]
                 + [_f(task.get(n, {}).get("mean")) for n in lengths]
                 + [_f(task.get(at, {}).get("per_task", {}).get(t), ".2f") for t in tasks]
                 + _retention_cells(r)
                 + [_f(first.get("search_us"), ".0f"), _f(first.get("build_s"), ".1f")])
        lines.append("| " + " | ".join(cells) + " |")
    trials = {n: max((r.get("tasks", {}).get(n, {}).get("trials", 0) for r in rows), default=0) for n in lengths}
    notes = [
        f"Model {config['model']}, fidelity at {config['tokens']} tokens (+{config['continuation']} continuation), "
        f"sinks {config['sinks']} + recent {config['recent']} always read; texts {', '.join(texts)}; "
        f"tasks over {config['task_filler']} filler, seeds {config['seeds']}.",
        f"Machine: {m.get('cpu')} ({m.get('cpu_count')} CPUs), torch {m.get('torch')}; "
        f"date {merged['date']}. `search us`: median of one search/attend call (one query, one layer) "
        f"on {texts[0]}, timed inside parallel shard processes.",
        "keys read: distinct keys attended per step over all keys, plus a re-rank's other candidates "
        "(`@rerank=R`: their K is read to score them, so R x keep of the keys' K).",
        "MagicPIG rows: sampled = mean fraction of the searched region sampled per query head; "
        f"recall columns relative to the top-K at keep {config['keeps'][0]}; keys read is set by (K, L).",
    ]
    if lengths:
        notes.append("Task trials per method and budget: " + ", ".join(f"{trials[n]} @{n}" for n in lengths)
                     + " (each a score in [0, 1]; `full` is dense attention).")
    if missing:
        notes.append(f"INCOMPLETE: {len(missing)} cells missing: {', '.join(missing)}")
    return ("\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
            + retention_markdown(ret_rows, config))


def _retention_cells(r: dict) -> list[str]:
    ret = r.get("retention")
    if not ret:
        return ["-", "-", "-"]
    wl = "-" if r["method"] in (FULL, "oracle") else _wl(ret, " / ")
    p = "-" if r["method"] in (FULL, "oracle") else _f(ret["sign_test_p"])
    return [f"{_f(ret['kept'])} ({ret['full_correct']})", wl, p]


def plot(merged: dict, rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = merged["config"]
    texts = [] if "fid" in config.get("skip", []) else config["texts"]
    lengths = task_lengths(config)
    ret_rows = [r for r in rows if "retention" in r and r["method"] != FULL]
    panels = len(texts) + len(lengths) + (2 if ret_rows else 0)
    rows_n = 1 if panels <= 3 else 2
    cols_n = -(-panels // rows_n)
    fig, grid = plt.subplots(rows_n, cols_n, figsize=(5 * cols_n, 4.2 * rows_n), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.axis("off")
    axes = axes[:panels]
    task_axes = dict(zip(lengths, axes[len(texts):]))
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    for label, rs in by_method.items():
        if label == FULL:
            continue
        style = "s" if "sampled_frac" in rs[0] else "o-"

        def x_of(r):
            return r["sampled_frac"] if "sampled_frac" in r else r["keep"]
        for ax, text in zip(axes, texts):
            pts = [(x_of(r), r["fidelity"][text]["mass_recall"]) for r in rs if text in r.get("fidelity", {})]
            if pts:
                ax.plot(*zip(*sorted(pts)), style, label=label)
        for length, ax in task_axes.items():
            pts = [(x_of(r), r["tasks"][length]["mean"]) for r in rs if length in r.get("tasks", {})]
            if pts:
                ax.plot(*zip(*sorted(pts)), style, label=label)
    for ax, text in zip(axes, texts):
        ax.set(title=f"attention-mass recall, {text}", xlabel="keys searched (fraction)", ylabel="mass recall")
    for length, ax in task_axes.items():
        full = next((r for r in rows if r["method"] == FULL and length in r.get("tasks", {})), None)
        if full:
            ax.axhline(full["tasks"][length]["mean"], color="k", ls="--", label="full")
        ax.set(title=f"task accuracy @{length} tokens", xlabel="keys searched (fraction)", ylabel="mean score")
    if ret_rows:
        draw_retention(axes[len(texts) + len(lengths):], ret_rows, config)
    if texts or lengths:
        legend_ax = axes[len(texts) + len(lengths) - 1]
        if legend_ax.get_legend_handles_labels()[0]:
            legend_ax.legend(fontsize=7, loc="lower right")
    pig = "; MagicPIG (squares) at its sampled fraction" if any("sampled_frac" in r for r in rows) else ""
    fig.suptitle(f"{config['model']} on {merged['machine'].get('cpu')} ({merged['date']}){pig}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
