"""Where the one-launch selection (kernels/row_select) spends its time, beside the four-launch
default, at batch 1 (the case it exists for).

Rows (each in its own CUDA graph, median replay, L2 flushed): the default selection and its
route + score launches; the one-launch kernel at 8 and 16 warps; its steps cut short (PHASE 1:
route + scores + pass-0 histogram; 3: everything after the keys but the barriers), with and
without the barriers (`GPU=False` skips the spin; the output is then wrong, the timing is the
work's); and the sparse attention after each selection.

`python -m ctxcache.bench.row_select_probe [--contexts 131072] [--batches 1] [--out DIR]`."""

from __future__ import annotations

import torch

from ctxcache.bench.fused_tune import cases
from ctxcache.bench.gpu_inputs import gpu_cli
from ctxcache.bench.step_probe import attend, timed
from ctxcache.decoder.gpu.attention import ATTN_CFG
from ctxcache.decoder.gpu.timing import device_info, print_table, write_results
from ctxcache.kernels.row_select import row_select_launch
from ctxcache.methods import Budget

CUTS = {  # name -> constexpr overrides of the one-launch kernel
    "full": {"PHASE": 0},
    "full_no_barrier": {"PHASE": 0, "GPU": False},
    "keys_hist0_barrier": {"PHASE": 1},
    "keys_hist0": {"PHASE": 1, "GPU": False},
    "keys_hist0_routed": {"PHASE": 1, "GPU": False, "ROUTE": False},
    "keys_walks_write": {"PHASE": 3, "GPU": False},
}


def probe(c, base: dict) -> list[dict]:
    default = c.selector(None, None)
    want = default.select(c.q, c.tables, c.lo, c.hi, c.kk)[..., :c.top_k].sort(-1).values.clone()
    attn = {k: ATTN_CFG[k] for k in ("block_n", "num_warps", "num_stages", "waves")}
    rows = [{**base, "method": "select_default", "time_us": timed(lambda: default.select(c.q, c.tables, c.lo, c.hi,
                                                                                          c.kk))},
            {**base, "method": "route_score_default",
             "time_us": timed(lambda: default.route_dense(c.q, c.tables, c.lo, c.hi, c.kk))},
            {**base, "method": "attention_after_default",
             "time_us": timed(lambda: attend(c, default.idx, attn, default.pdl))}]
    t = c.tables
    for warps in (8, 16):
        sel = c.selector(None, None)
        if not sel.set_row_select(True):
            raise SystemExit("row_select does not apply to this case")
        sel.row_warps = warps
        got = sel.select(c.q, t, c.lo, c.hi, c.kk)[..., :c.top_k].sort(-1).values
        same = torch.equal(got, want)
        launch = row_select_launch(c.q, t.centroids, t.dense_score, t.score_scale, t.new_scores, t.n_ctx,
                                   t.stream_start, t.stream_count, c.lo, c.hi, c.kk, sel.ids, sel.w, sel.row_ws,
                                   sel.idx, sel.row_programs, sel.n_pad // sel.row_programs, False, True, sel.pdl,
                                   warps, True)
        for name, over in CUTS.items():
            rows.append({**base, "method": f"row_w{warps}_{name}", "time_us": timed(lambda: launch(**over)),
                         "same_selection": same})
        sel.select(c.q, t, c.lo, c.hi, c.kk)
        rows.append({**base, "method": f"attention_after_row_w{warps}",
                     "time_us": timed(lambda: attend(c, sel.idx, attn, sel.pdl))})
        rows.append({**base, "method": f"step_row_w{warps}",
                     "time_us": timed(lambda: attend(c, sel.select(c.q, t, c.lo, c.hi, c.kk), attn, sel.pdl))})
    rows.append({**base, "method": "step_default",
                 "time_us": timed(lambda: attend(c, default.select(c.q, t, c.lo, c.hi, c.kk), attn, default.pdl))})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = gpu_cli("ctxcache bench row_select_probe", "131072", argv)
    if args is None:
        return 2
    rows = []
    for c in cases(args, Budget(), "int8"):
        got = probe(c, {"context": c.n, "batch": c.batch, "top_k": c.top_k})
        print_table(got, ["context", "batch", "method", "time_us", "same_selection"])
        rows += got
        del c
    path = write_results("row_select_probe", rows, {"cuts": CUTS}, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
