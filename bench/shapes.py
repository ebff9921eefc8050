"""`ctxcache bench shapes`: the decode step's selection kernels at the launch shapes they can take,
on this GPU, beside the shapes the decoder runs.

    ctxcache bench shapes [--shapes 32768x8,32768x1,126976x4] [--kernels scores,topk,attention,logits]

Why: shapes tuned on one card need not suit another. The int8 score kernel's H100 shape (4 warps,
96 registers) was 27-33% slower on the H200 than its best there (DESIGN.md), and the GPU lent
may be either. Llama-3.1-8B shapes, random int8 tables, one layer; each shape is captured in a
CUDA graph and timed by replay (median, L2 flushed) and its output checked against the
default's: `same` (the same keys, or the same selected sets) or, for the attention, its largest
difference. Kernels:
- scores: route + int8 scores + radix pass 0 (GpuSelector.dot8_cfg: keys a program, warps,
  register cap);
- topk: the whole select at each radix shape (GpuSelector.set_topk_block);
- attention: the split-K attention of the selection (waves, keys a block, warps, stages);
- logits: the re-rank at the default rerank (Reranker.set_logits_shape: candidates a step, warps);
- carried: the attention a carried row runs over its K + follow + 1 candidates, writing their
  logits as a lean step does (kernels/carried_attention.py: splits, keys a block, warps, stages).
Writes shapes_<device>.json and prints each kernel's default and best per shape."""

from __future__ import annotations

import argparse
import sys
import itertools
from typing import Callable

import torch

from ctxcache.bench.attention import attend, attn_splits, step_inputs
from ctxcache.bench.common.gpu import D, HKV, HQ, batch_dense_tables
from ctxcache.bench.common.report import add_out, print_table, write_result
from ctxcache.decoder.gpu.attention import ATTN_CFG
from ctxcache.decoder.gpu.selector import GpuSelector
from ctxcache.kernels.carried_attention import carried_attention
from ctxcache.kernels.rerank import Reranker
from ctxcache.kernels.split_k_attention import choose_splits, partial_workspace
from ctxcache.kernels.timing import capture_graph, time_us
from ctxcache.methods import Budget
from ctxcache.methods.csattention_params import CSAttentionParams

KERNELS = ("scores", "topk", "attention", "logits", "carried")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'32768x8,126976x4' -> [(32768, 8), (126976, 4)] (ValueError naming the bad one)."""
    shapes = []
    for part in (p for p in text.split(",") if p):
        n, _, b = part.partition("x")
        if not (n.isdigit() and b.isdigit() and int(n) >= 1024 and int(b) >= 1):
            raise ValueError(f"--shapes {part!r} must be CONTEXTxBATCH, e.g. 32768x8 (context >= 1024)")
        shapes.append((int(n), int(b)))
    if not shapes:
        raise ValueError("--shapes names no shape")
    return shapes


def timed(fn: Callable[[], object]) -> float:
    return round(time_us(capture_graph(fn).replay), 2)


def sweep(kernel: str, configs: list[dict], default: dict, run: Callable[[dict], Callable[[], object]],
          check: Callable[[], dict], base: dict) -> list[dict]:
    """One kernel's rows: for each config, run(config) gives the launch (applied), check() the
    output comparison with the default's. A config that does not compile is a row with its error."""
    rows = []
    for cfg in configs:
        try:
            fn = run(cfg)
            fn()
            row = {**base, "kernel": kernel, **cfg, **check(), "time_us": timed(fn), "default": cfg == default}
        except Exception as e:  # noqa: BLE001 - a shape the compiler refuses is a result too
            row = {**base, "kernel": kernel, **cfg, "error": str(e).splitlines()[0][:160], "default": cfg == default}
        rows.append(row)
        print(row, flush=True)
    run(default)
    return rows


def shape_rows(n: int, batch: int, kernels: list[str], dev: str) -> list[dict]:
    budget, params = Budget(), CSAttentionParams()
    q, k, v, nt, lo, hi, kk = step_inputs(n, batch, budget, dev)
    tables = batch_dense_tables(batch, n, params, dev, "int8")
    k_sel = int(kk[0])
    sel = GpuSelector(params, batch, HQ, HKV, D, n, k_sel, dev)
    base = {"context": n, "batch": batch}
    rows: list[dict] = []
    if "scores" in kernels:
        default = dict(sel.dot8_cfg)
        sel.route_dense(q, tables, lo, hi, kk)
        want = sel.keys.clone(), sel.ws.clone()

        def run_scores(cfg):
            sel.dot8_cfg = cfg
            return lambda: sel.route_dense(q, tables, lo, hi, kk)
        configs = [{"block": b, "num_warps": w, "maxnreg": r} for b, w, r in
                   itertools.product((512, 1024, 2048, 4096), (2, 4, 8), (96, 128, None)) if sel.n_pad % b == 0]
        rows += sweep("scores", configs, default, run_scores,
                      lambda: {"same": torch.equal(sel.keys, want[0]) and torch.equal(sel.ws, want[1])}, base)
    chosen = sel.select(q, tables, lo, hi, kk)[..., :k_sel].sort(-1).values.clone()
    if "topk" in kernels:
        default = {"block": sel.topk_block, "num_warps": sel.topk_warps}

        def run_topk(cfg):
            sel.set_topk_block(cfg["block"], cfg["num_warps"])
            return lambda: sel.select(q, tables, lo, hi, kk)
        configs = [{"block": b, "num_warps": w} for b, w in itertools.product((1024, 2048, 4096), (2, 4, 8))
                   if sel.n_pad % b == 0]
        rows += sweep("topk", configs, default, run_topk, lambda: {
            "same": torch.equal(sel.idx[..., :k_sel].sort(-1).values, chosen)}, base)
    idx = sel.select(q, tables, lo, hi, kk).clone()
    if "attention" in kernels:
        want_o = attend(q, k, v, nt, idx, kk, budget, attn_splits(batch, k_sel, budget), sel.pdl).float().clone()
        got: dict = {}

        def run_attention(cfg):
            full = {**ATTN_CFG, **cfg}
            splits = attn_splits(batch, k_sel, budget, full)

            def fn():
                got["o"] = attend(q, k, v, nt, idx, kk, budget, splits, sel.pdl, full)
            return fn
        configs = [{"waves": w, "block_n": bn, "num_warps": nw, "num_stages": st} for w, bn, nw, st in
                   itertools.product((1, 2, 4), (64, 128), (4, 8), (None, 2))]
        default = {k_: ATTN_CFG[k_] for k_ in ("waves", "block_n", "num_warps", "num_stages")}
        rows += sweep("attention", configs, default, run_attention,
                      lambda: {"max_err": float((got["o"].float() - want_o).abs().max())}, base)
    if "logits" in kernels:
        rows += logits_rows(q, k, nt, lo, hi, kk, tables, budget, base)
    if "carried" in kernels:
        rows += carried_rows(q, k, v, nt, lo, hi, kk, tables, budget, params, base)
    return rows


def carried_rows(q, k, v, nt, lo, hi, kk, tables, budget: Budget, params: CSAttentionParams, base: dict) -> list[dict]:
    """A lean step's attention: every row carries K + follow + 1 candidates (the estimate's best
    that many here, in key order), their logits written for the re-rank; split as
    GpuSparseAttention splits it (for its largest candidate list), then half and twice that."""
    batch, k_sel = q.shape[0], int(kk[0])
    kc = torch.full_like(kk, k_sel + params.follows + 1)
    listed = max(params.candidates(k_sel, int(hi[0] - lo[0])), int(kc[0])) + budget.sinks + budget.recent
    served = choose_splits(batch * HKV, listed, min_keys=ATTN_CFG["min_keys"], waves=ATTN_CFG["waves"])
    sel = GpuSelector(params, batch, HQ, HKV, D, k.shape[2], int(kc[0]), q.device)
    cand = sel.select(q, tables, lo, hi, kc).sort(-1).values.contiguous()
    carried = torch.ones_like(kk)
    logits = torch.empty(batch * HKV, HQ // HKV, cand.shape[-1], dtype=torch.float32, device=q.device)
    got: dict = {}

    def run_carried(cfg):
        ws = partial_workspace(batch, HQ, HKV, cfg["splits"], D, q.device)

        def fn():
            got["o"] = carried_attention(q, k, v, nt, cand, kk, cand, kc, carried, budget.sinks, budget.recent,
                                         cfg["splits"], ws, logits=logits, block_n=cfg["block_n"], pdl=sel.pdl,
                                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return fn
    default = {"splits": served, **{k_: ATTN_CFG[k_] for k_ in ("block_n", "num_warps", "num_stages")}}
    run_carried(default)()
    want = got["o"].float().clone()
    configs = [{"splits": sp, "block_n": bn, "num_warps": nw, "num_stages": st} for sp, bn, nw, st in
               itertools.product(sorted({max(1, served // 2), served, served * 2}), (32, 64, 128), (4, 8), (None, 2))]
    return sweep("carried", configs, default, run_carried,
                 lambda: {"max_err": float((got["o"].float() - want).abs().max())}, base)


def logits_rows(q, k, nt, lo, hi, kk, tables, budget: Budget, base: dict) -> list[dict]:
    """The re-rank (the default rerank: the selector's candidates, follow off) at each logits shape."""
    batch, n = q.shape[0], k.shape[2]
    params = CSAttentionParams()  # the default re-rank
    k_sel = int(kk[0])
    kc_max = params.candidates(k_sel, int(hi[0] - lo[0]))
    kc = torch.full_like(kk, kc_max)
    sel = GpuSelector(params, batch, HQ, HKV, D, n, kc_max, q.device)
    cand = sel.select(q, tables, lo, hi, kc).clone()
    rr = Reranker(batch, HKV, HQ // HKV, kc_max, k_sel, q.device, pdl=sel.pdl)
    default = {"block": rr.logits_block, "num_warps": rr.logits_warps}
    chosen = rr(q, k, cand, kc, kk, lo, hi, nt, budget.sinks, budget.recent)[..., :k_sel].sort(-1).values.clone()
    got: dict = {}

    def run_logits(cfg):
        rr.set_logits_shape(cfg["block"], cfg["num_warps"])

        def fn():
            got["pos"] = rr(q, k, cand, kc, kk, lo, hi, nt, budget.sinks, budget.recent)
        return fn
    configs = [{"block": b, "num_warps": w} for b, w in itertools.product((64, 128, 256), (4, 8))]
    return sweep("logits", configs, default, run_logits,
                 lambda: {"same": torch.equal(got["pos"][..., :k_sel].sort(-1).values, chosen)}, base)


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (kernel, shape): the default's time and the fastest valid config."""
    out = []
    for key in sorted({(r["kernel"], r["context"], r["batch"]) for r in rows}):
        mine = [r for r in rows if (r["kernel"], r["context"], r["batch"]) == key and "time_us" in r
                and r.get("same", True) and r.get("max_err", 0.0) < 1e-2]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["time_us"])
        default = next((r["time_us"] for r in mine if r["default"]), None)
        shape = {k: v for k, v in best.items() if k not in ("kernel", "context", "batch", "time_us", "default", "same",
                                                           "max_err")}
        out.append({"kernel": key[0], "context": key[1], "batch": key[2], "default_us": default,
                    "best_us": best["time_us"], "best": shape})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="32768x8,32768x1,126976x4", help="CONTEXTxBATCH, comma separated")
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"any of {', '.join(KERNELS)}")
    add_out(ap)
    args = ap.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    try:
        shapes = parse_shapes(args.shapes)
        if not kernels or set(kernels) - set(KERNELS):
            raise ValueError(f"--kernels {args.kernels!r}: choose from {', '.join(KERNELS)}")
    except ValueError as e:
        print(f"ctxcache bench shapes: error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ctxcache bench shapes: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for n, batch in shapes:
        rows += shape_rows(n, batch, kernels, "cuda")
        torch.cuda.empty_cache()
    summary = best_rows(rows)
    path = write_result("shapes", {"shapes": args.shapes, "kernels": kernels, "summary": summary, "results": rows},
                        args.out)
    print_table(summary, ["kernel", "context", "batch", "default_us", "best_us", "best"])
    print(f"wrote {path}")
    return 0
