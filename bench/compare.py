"""`ctxcache bench compare`: every sparse method side by side in one table.

For each method (and `full`, dense attention), each keep budget and each built-in text:
- fidelity on the real model exactly as `bench fidelity` measures it (bench/common/capture.py,
  selection.py, model_scores.py; one capture per text, reused by every method and
  budget; tables built once per method and text, reused by every budget);
- the task suite (bench/common/tasks.py, run_suite: passkey, NIAH single / multikey /
  multivalue, variable tracking, common words) at the same budgets and seeds;
- answer retention (bench/common/copy_tasks.py, retention.py): contexts of many exact-copy
  needles and document questions, one prefill per context for every method; per method the
  fraction of full attention's correct answers it keeps, with a paired sign test against the
  oracle at the same keep (`--retention-*`);
- the per-step selection cost on this CPU: wall time of one `search` call (selectors) or one
  `attend` call (estimators: MagicPIG, Multipole) for one decode query of one layer, median
  over every layer and the first `--timing-steps` continuation steps, in microseconds. `full`
  times dense attention of that query over every key, for reference.
MagicPIG has no keep budget: its (K, L) configs run once each; its row reports the sampled
fraction of the searched region next to the paper's Table 8 value, and its recall columns
are relative to the top-K at the first keep (5%).

A method may carry parameters: `csattention@rerank=4` is csattention with rerank=4.0
(values are JSON literals). MagicPIG (own budget) is left out of retention.

The work is cut into cells (`fid:TEXT:METHOD`, `task:LENGTH:KIND:SEED`, `ret:LENGTH:FILLER:SEED`) so it can run as
parallel processes: `--shard i/n` (or `--cells a,b,...`) runs a subset and writes one shard
JSON (rewritten after each cell; a rerun skips cells already in it). `--merge DIR` merges the
shard JSONs of DIR into compare_<device>.json, .md and .png (no model needed; `merge`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ctxcache.decoder import SparseConfig
from ctxcache.methods import Budget, make_method
from ctxcache.methods.magicpig import PAPER_CONFIGS, PAPER_TABLE8, sampled_fraction

from ctxcache.bench.common.report import SCRATCH, add_out, commit, device_tag, machine_info
from ctxcache.bench.common.retention_report import draw_retention, retention_markdown, summarize_retention
from ctxcache.bench.common.retention_suites import add_suite_args, apply_suite, retention_spec, suite_config
from ctxcache.bench.common.selection import dense_cost_us, selection_cost_us
from ctxcache.bench.common.texts import KINDS

DEFAULT_METHODS = "full,oracle,csattention,csattention-paper,key-kmeans,quest,ctkvr,prehoc,multipole,magicpig"
DEFAULT_TASKS = "passkey,niah_single,niah_multikey,niah_multivalue,vt,cwe"
FULL = "full"
ANSWER_RESERVE = 192  # question + answer tokens kept free below the model's maximum length


# ---------------------------------------------------------------- configuration and cells

@dataclass(frozen=True)
class MethodSpec:
    """A row of the table: label, registered method name and parameters; `keeps` None means
    the method's own parameters set its budget (MagicPIG)."""

    label: str
    name: str
    params: dict
    own_budget: bool = False


def _with_params(entry: str) -> tuple[str, dict]:
    """`name@key=value@...` -> (name, {key: JSON value})."""
    name, *pairs = entry.split("@")
    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"method {entry!r}: {pair!r} must look like key=value")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"method {entry!r}: {value!r} is no JSON literal") from e
    return name, params


def method_specs(names: str) -> list[MethodSpec]:
    """Comma-separated method names -> specs; `magicpig` expands to the paper's (K, L) configs;
    `name@key=value` sets a parameter (the label stays the entry)."""
    specs = []
    for entry in [n.strip() for n in names.split(",") if n.strip()]:
        name, params = _with_params(entry)
        if params:
            make_method(name, params)  # unknown names and bad values fail here, before any work
            specs.append(MethodSpec(entry, name, params))
        elif name == "magicpig":
            specs += [MethodSpec(f"magicpig-K{k}-L{l}", name, {"bits": k, "tables": l}, True)
                      for k, l in PAPER_CONFIGS]
        else:
            if name != FULL:
                make_method(name)  # unknown names fail here, before any work
            specs.append(MethodSpec(name, name, {}))
    if not specs:
        raise ValueError("--methods names no method")
    return specs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ctxcache bench compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096, help="fidelity context length N")
    ap.add_argument("--continuation", type=int, default=256, help="teacher-forced decode steps")
    ap.add_argument("--keeps", default="0.05,0.10", help="keep budgets (fraction of the keys)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=32)
    ap.add_argument("--texts", default="prose,code")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated; 'full' = dense")
    ap.add_argument("--stride", type=int, default=8, help="score every stride-th decode step")
    ap.add_argument("--tasks", default=DEFAULT_TASKS)
    ap.add_argument("--task-lengths", default="4096", help="e.g. 2048,4096,8192 (context tokens)")
    ap.add_argument("--task-filler", default="prose", choices=("prose", "code"))
    ap.add_argument("--seeds", default="0,1", help="task seeds")
    ap.add_argument("--task-groups", type=int, default=1,
                    help="split each task cell's methods into this many cells (each re-prefills)")
    ap.add_argument("--retention-lengths", default="2048,4096,6144", help="'' skips retention")
    ap.add_argument("--retention-fillers", default=",".join(KINDS), help="kinds of document (bench/texts/)")
    ap.add_argument("--retention-seeds", default="0,1,2")
    ap.add_argument("--retention-keeps", default="0.05")
    ap.add_argument("--doc-questions", type=int, default=3, help="document questions per context")
    add_suite_args(ap)
    ap.add_argument("--skip", default="", help="comma-separated cell kinds to leave out: fid, task, ret")
    ap.add_argument("--timing-steps", type=int, default=4, help="continuation steps timed per layer")
    ap.add_argument("--shard", default=None, help="i/n: run every n-th cell starting at i")
    ap.add_argument("--cells", default=None, help="comma-separated cell ids (see --list-cells)")
    ap.add_argument("--list-cells", action="store_true")
    add_out(ap, SCRATCH / "compare_shards", what="the shard JSONs")
    ap.add_argument("--merge", default=None, metavar="DIR", help="merge the shard JSONs of DIR")
    add_out(ap, SCRATCH, "--results", "what --merge writes (JSON, table, PNG)")
    ap.add_argument("--name", default=None, help="output name (default compare_DEVICE)")
    args = ap.parse_args(argv)
    apply_suite(args, ap)
    args.keep_list = [float(x) for x in args.keeps.split(",") if x]
    args.seed_list = [int(x) for x in args.seeds.split(",") if x]
    args.length_list = [int(x) for x in args.task_lengths.split(",") if x]
    args.text_list = [x for x in args.texts.split(",") if x]
    args.task_list = [x for x in args.tasks.split(",") if x]
    args.ret_lengths = [int(x) for x in args.retention_lengths.split(",") if x]
    args.ret_fillers = [x for x in args.retention_fillers.split(",") if x]
    args.ret_seeds = [int(x) for x in args.retention_seeds.split(",") if x]
    args.ret_keeps = [float(x) for x in args.retention_keeps.split(",") if x]
    args.skip_list = [x for x in args.skip.split(",") if x]
    if set(args.skip_list) - {"fid", "task", "ret"}:
        ap.error(f"--skip={args.skip} names kinds other than fid, task, ret")
    if not all(0 < k <= 1 for k in args.ret_keeps):
        ap.error(f"--retention-keeps={args.retention_keeps} must be fractions in (0, 1]")
    if not args.keep_list or not all(0 < k <= 1 for k in args.keep_list):
        ap.error(f"--keeps={args.keeps} must be fractions in (0, 1]")
    if args.tokens < 64 or args.continuation < 2:
        ap.error(f"--tokens={args.tokens} must be >= 64 and --continuation={args.continuation} >= 2")
    if args.task_groups < 1:
        ap.error(f"--task-groups={args.task_groups} must be >= 1")
    if args.shard is not None and args.cells is not None:
        ap.error("give --shard or --cells, not both")
    return args


def config_of(args: argparse.Namespace) -> dict:
    """What must match across shards for them to merge into one table."""
    return {"model": args.model, "tokens": args.tokens, "continuation": args.continuation,
            "keeps": args.keep_list, "sinks": args.sinks, "recent": args.recent,
            "texts": args.text_list, "methods": args.methods, "stride": args.stride,
            "tasks": args.task_list, "task_lengths": args.length_list, "task_filler": args.task_filler,
            "seeds": args.seed_list, "timing_steps": args.timing_steps, "task_groups": args.task_groups,
            "retention": {"lengths": args.ret_lengths, "fillers": args.ret_fillers, "seeds": args.ret_seeds,
                          "keeps": args.ret_keeps, "doc_questions": args.doc_questions, **suite_config(args)},
            "skip": args.skip_list}


def all_cells(config: dict) -> list[str]:
    """Every cell id, fidelity first (grouped by text so a shard's captures are shared)."""
    labels = [m.label for m in method_specs(config["methods"])]
    fid = [f"fid:{text}:{label}" for text in config["texts"] for label in labels]
    groups = config.get("task_groups", 1)
    suffix = [""] if groups == 1 else [f":g{g}of{groups}" for g in range(groups)]
    tasks = [f"task:{n}:{kind}:{seed}{g}" for n in config["task_lengths"] for seed in config["seeds"]
             for kind in config["tasks"] for g in suffix]
    ret = config.get("retention") or {"lengths": []}
    rets = [f"ret:{n}:{f}:{s}" for n in ret["lengths"] for s in ret["seeds"] for f in ret["fillers"]]
    skip = set(config.get("skip", []))
    return [c for c in fid + tasks + rets if c.split(":")[0] not in skip]


def pick_cells(args: argparse.Namespace, cells: list[str]) -> list[str]:
    if args.cells:
        wanted = [c.strip() for c in args.cells.split(",") if c.strip()]
        unknown = sorted(set(wanted) - set(cells))
        if unknown:
            raise ValueError(f"unknown cell(s) {unknown}; --list-cells shows the valid ones")
        return wanted
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError(f"--shard {args.shard}: need 0 <= i < n")
        return cells[i::n]
    return cells


# ---------------------------------------------------------------- measuring one cell

class Runner:
    """Loads the model once and keeps one capture per text for the cells of this process."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ctxcache.models.loader import load_model
        self.args = args
        self.lm = load_model(args.model, device=args.device)
        self.specs = {m.label: m for m in method_specs(args.methods)}
        self._captures: dict[str, tuple] = {}
        self._tables: dict[tuple[str, str], tuple[list, float]] = {}  # one text's builds

    def capture(self, text: str):
        from ctxcache.bench.common.capture import capture
        from ctxcache.bench.common.texts import builtin_text, tokens_of
        if text not in self._captures:
            self._captures.clear()  # one text at a time bounds memory
            a = self.args
            ids = tokens_of(self.lm.tokenizer, builtin_text(text), a.tokens + a.continuation, text)
            self._captures[text] = (ids, capture(self.lm, ids, a.tokens))
        return self._captures[text]

    def run(self, cell: str) -> list[dict]:
        kind, *rest = cell.split(":")
        if kind == "fid":
            return self.fidelity(rest[0], self.specs[rest[1]])
        if kind == "ret":
            return self.retention(int(rest[0]), rest[1], int(rest[2]))
        labels = list(self.specs)
        if len(rest) == 4:  # method group g of G: every G-th label from g
            g, n = (int(x) for x in rest[3].removeprefix("g").split("of"))
            labels = labels[g::n]
        return self.tasks(int(rest[0]), rest[1], int(rest[2]), labels)

    def fidelity(self, text: str, spec: MethodSpec) -> list[dict]:
        from ctxcache.bench.common.selection import selection_metrics
        from ctxcache.bench.common.model_scores import teacher_forced
        a = self.args
        ids, cap = self.capture(text)
        base = {"kind": "fidelity", "text": text, "method": spec.label, "name": spec.name,
                "params": spec.params, "tokens": a.tokens}
        if spec.name == FULL:
            config = SparseConfig(Budget(a.keep_list[0], a.sinks, a.recent))
            row = {**base, "keep": None, **teacher_forced(self.lm, ids, cap, None, None, config),
                   "search_us": dense_cost_us(cap, a.timing_steps)}
            return [row]
        method = make_method(spec.name, spec.params)
        tables, build_s = self._build(text, spec, method, cap)
        rows = []
        for keep in a.keep_list[:1] if spec.own_budget else a.keep_list:
            config = SparseConfig(Budget(keep, a.sinks, a.recent))
            opened: list = []
            row = {**base, "keep": None if spec.own_budget else keep, "build_s": build_s,
                   **selection_metrics(method, tables, cap, config.budget, a.stride, opened)}
            if spec.own_budget:
                row["recall_reference_keep"] = keep
                row["sampled_frac"] = sampled_fraction(opened)
                row["paper_table8"] = PAPER_TABLE8.get((spec.params["bits"], spec.params["tables"]))
            del opened
            row.update(teacher_forced(self.lm, ids, cap, method, tables, config))
            row["search_us"] = selection_cost_us(method, tables, cap, config.budget, a.timing_steps)
            rows.append(row)
        return rows

    def _build(self, text: str, spec: MethodSpec, method, cap) -> tuple[list, float]:
        """Tables and build seconds, shared by methods that differ only in search parameters."""
        from ctxcache.bench.common.capture import build_tables
        from ctxcache.bench.common.retention import build_key
        key = (text, build_key(spec.name, spec.params))
        if key not in self._tables:
            self._tables = {k: v for k, v in self._tables.items() if k[0] == text}
            t0 = time.perf_counter()
            tables = build_tables(method, cap)
            self._tables[key] = (tables, time.perf_counter() - t0)
        return self._tables[key]

    def tasks(self, length: int, kind: str, seed: int, labels: list[str]) -> list[dict]:
        from ctxcache.bench.common.tasks import run_suite
        from ctxcache.bench.common.tasks import TaskSpec
        a = self.args
        n_ctx = min(length, self.lm.args.max_seq_len - ANSWER_RESERVE)
        specs = [self.specs[label] for label in labels]
        methods = {m.label: (m.name, m.params) for m in specs}
        own = {m.label: a.keep_list[:1] for m in specs if m.own_budget}
        rows = run_suite(self.lm, methods, [TaskSpec(kind, n_ctx, a.task_filler)], a.keep_list, [seed],
                         a.sinks, a.recent, keeps_by_method=own)
        for row in rows:
            row.update(kind="task", length=length)
            if row["method"] in own:
                row["keep"] = None
            if row["method"] == FULL:
                row["keep"] = None
        return rows


    def retention(self, length: int, filler: str, seed: int) -> list[dict]:
        from ctxcache.bench.common.retention import run_context
        a = self.args
        n_ctx = min(length, self.lm.args.max_seq_len - ANSWER_RESERVE)
        methods = {m.label: (m.name, m.params) for m in self.specs.values() if not m.own_budget}
        return run_context(self.lm, methods, retention_spec(a, n_ctx, filler), seed, a.ret_keeps,
                           a.sinks, a.recent)


# ---------------------------------------------------------------- shards

def _shard_path(args: argparse.Namespace) -> Path:
    tag = args.shard.replace("/", "of") if args.shard else ("cells" if args.cells else "all")
    return Path(args.out) / f"shard_{tag}.json"


def run_shard(args: argparse.Namespace) -> Path:
    config = config_of(args)
    cells = pick_cells(args, all_cells(config))
    path = _shard_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    done: dict = {}
    if path.exists():
        old = json.loads(path.read_text())
        if old["config"] != config:
            raise ValueError(f"{path} was made with another configuration; use another --out")
        done = old["cells"]
    todo = [c for c in cells if c not in done]
    print(f"[compare] {len(cells)} cells, {len(todo)} to run -> {path}", file=sys.stderr, flush=True)
    runner = Runner(args) if todo else None
    for cell in tqdm(todo, desc="compare cells", unit="cell", file=sys.stderr):
        t0 = time.perf_counter()
        done[cell] = {"rows": runner.run(cell), "seconds": time.perf_counter() - t0}
        _write(path, {"bench": "compare", "config": config, "machine": machine_info(), "commit": commit(),
                      "date": dt.date.today().isoformat(), "cells": done})
        print(f"[compare] {cell} {done[cell]['seconds']:.0f}s", file=sys.stderr, flush=True)
    return path


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


# `ctxcache bench compare --merge DIR`: shard JSONs -> one JSON, a Markdown table, PNG plots


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
    commits = sorted({str(s.get("commit")) for s in shards})
    return {"config": config, "machine": shards[0]["machine"], "date": max(s["date"] for s in shards),
            "commit": commits[0] if len(commits) == 1 else commits,
            "cells": cells, "shard_files": [f.name for f in files]}


def summarize(merged: dict) -> list[dict]:
    """One row per (method, keep): fidelity per text, task accuracy per task and overall."""
    config, cells = merged["config"], merged["cells"]
    fid = [r for c in cells.values() for r in c["rows"] if r["kind"] == "fidelity"]
    tasks = [r for c in cells.values() for r in c["rows"] if r["kind"] == "task"]
    ret = [r for c in cells.values() for r in c["rows"] if r["kind"] == "retention"]
    ret_keeps = (config.get("retention") or {}).get("keeps", [])
    rows = []
    for spec in method_specs(config["methods"]):
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


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


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
    wl = "-" if r["method"] in (FULL, "oracle") else f"{ret['vs_oracle_wins']} / {ret['vs_oracle_losses']}"
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


def merge(args: argparse.Namespace) -> dict[str, Path]:
    merged = load_shards(Path(args.merge))
    merged["missing_cells"] = [c for c in all_cells(merged["config"]) if c not in merged["cells"]]
    rows = summarize(merged)
    name = args.name or f"compare_{device_tag(merged['machine'])}"
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": out / f"{name}.png"}
    raw = [r for c in merged["cells"].values() for r in c["rows"]]
    _write(paths["json"], {"bench": "compare", "date": merged["date"], "commit": merged["commit"],
                           "machine": merged["machine"],
                           "config": merged["config"], "missing_cells": merged["missing_cells"],
                           "cell_seconds": {k: c["seconds"] for k, c in merged["cells"].items()},
                           "rows": rows, "raw": raw})
    paths["md"].write_text(markdown(merged, rows))
    try:
        plot(merged, rows, paths["png"])
    except ImportError:  # matplotlib is the `bench` extra
        print("matplotlib is not installed (pip install 'ctxcache[bench]'): no PNG written", file=sys.stderr)
        del paths["png"]
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_cells:
        print("\n".join(pick_cells(args, all_cells(config_of(args)))))
        return 0
    if args.merge:
        paths = merge(args)
        print(paths["md"].read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    torch.manual_seed(0)
    path = run_shard(args)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
