"""`ctxcache bench compare`: every sparse method side by side in one table.

For each method (and `full`, dense attention), each keep budget and each built-in text:
- fidelity on the real model exactly as `bench fidelity` measures it (quality/capture.py,
  selection.py, model_scores.py; one capture per text, reused by every method and
  budget; tables built once per method and text, reused by every budget);
- the task suite (quality/tasks.py, run_suite: passkey, NIAH single / multikey /
  multivalue, variable tracking, common words) at the same budgets and seeds;
- answer retention (quality/copy_tasks.py, retention.py): contexts of many exact-copy
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
from ctxcache.bench.common.compare_report import FULL, load_shards, markdown, plot, summarize
from ctxcache.bench.common.suite_args import add_suite_args, apply_suite, retention_spec, suite_config
from ctxcache.quality.selection import dense_cost_us, selection_cost_us

DEFAULT_METHODS = "full,oracle,csattention,csattention-paper,key-kmeans,quest,ctkvr,prehoc,multipole,magicpig"
DEFAULT_TASKS = "passkey,niah_single,niah_multikey,niah_multivalue,vt,cwe"
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
    # None: the suite's own (quality/retention_suites.py), so any value given, a default included, stands
    ap.add_argument("--retention-lengths", default=None, help="'' skips retention (default: the suite's)")
    ap.add_argument("--retention-fillers", default=None, help="kinds of document (quality/corpus/)")
    ap.add_argument("--retention-seeds", default=None)
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
        from ctxcache.quality.capture import capture
        from ctxcache.quality.texts import builtin_text, tokens_of
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
        from ctxcache.quality.selection import selection_metrics
        from ctxcache.quality.model_scores import teacher_forced
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
        from ctxcache.quality.capture import build_tables
        from ctxcache.quality.retention import build_key
        key = (text, build_key(spec.name, spec.params))
        if key not in self._tables:
            self._tables = {k: v for k, v in self._tables.items() if k[0] == text}
            t0 = time.perf_counter()
            tables = build_tables(method, cap)
            self._tables[key] = (tables, time.perf_counter() - t0)
        return self._tables[key]

    def tasks(self, length: int, kind: str, seed: int, labels: list[str]) -> list[dict]:
        from ctxcache.quality.tasks import run_suite
        from ctxcache.quality.tasks import TaskSpec
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
        from ctxcache.quality.retention import run_context
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
    code = commit()  # the code this process imported: a commit made while it runs is not it
    for cell in tqdm(todo, desc="compare cells", unit="cell", file=sys.stderr):
        t0 = time.perf_counter()
        # each cell keeps its own commit: a resumed shard holds cells of several processes
        done[cell] = {"rows": runner.run(cell), "seconds": time.perf_counter() - t0, "commit": code}
        _write(path, {"bench": "compare", "config": config, "machine": machine_info(), "commit": code,
                      "date": dt.date.today().isoformat(), "cells": done})
        print(f"[compare] {cell} {done[cell]['seconds']:.0f}s", file=sys.stderr, flush=True)
    return path


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


# `ctxcache bench compare --merge DIR`: shard JSONs -> one JSON, a Markdown table, PNG plots


def merge(args: argparse.Namespace) -> dict[str, Path]:
    merged = load_shards(Path(args.merge))
    merged["missing_cells"] = [c for c in all_cells(merged["config"]) if c not in merged["cells"]]
    rows = summarize(merged, method_specs(merged["config"]["methods"]))
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
