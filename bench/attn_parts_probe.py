"""Where the sparse attention's time goes, one process, the attention bench's harness (one
CUDA graph each, median replay, L2 flushed), int8 tables' default selection:

- the merge of the split partials: separate launch at 4 / 2 / 1 warps per program, and fused
  into the split kernel (its last program per row merges), each as the attention alone and as
  the whole step (selection + attention);
- the split-K kernel alone, the merge alone, both, for a few split counts and key blocks;
- a bound: route + score, then the attention over an index list collected beforehand (what
  taking radix pass 1 and the collect off the chain could be worth at most);
- the bytes' floors: bench/floor.py's gather of the selected K/V rows at several blocks, and
  streams of as many contiguous bytes (floor.py's stream kernel at several grids, torch copy).

`python -m ctxcache.bench.attn_parts_probe [--contexts 131072] [--batches 1,8] [--out DIR]`
(`ctxcache bench attn_parts_probe`, `bench/gpu_suite.sh parts`)."""

from __future__ import annotations

import torch

from ctxcache.bench.attention import attend
from ctxcache.bench.step_probe import timed
from ctxcache.bench.floor import _gather_kernel, _stream_kernel
from ctxcache.bench.fused_tune import cases
from ctxcache.bench.gpu_inputs import gpu_cli
from ctxcache.decoder.gpu.attention import ATTN_CFG
from ctxcache.decoder.gpu.timing import device_info, print_table, write_results
from ctxcache.kernels.sparse_attention import merge_partials, partial_workspace, sparse_decode_attention
from ctxcache.methods import Budget


def parts(c, idx, splits: int, pdl: bool, block_n: int, warps: int) -> dict:
    """The split kernel and the merge (as sparse_decode_attention launches them), alone and together."""
    hkv = c.k.shape[1]
    ws = partial_workspace(c.batch, c.q.shape[1], hkv, splits, c.q.shape[2], "cuda")
    out = torch.empty_like(c.q)

    def split():
        sparse_decode_attention(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget.sinks, c.budget.recent, splits=splits,
                                out=out, ws=ws, block_n=block_n, pdl=pdl, num_warps=warps, partials_only=True)

    def both():
        split()
        merge_partials(ws, out, hkv, splits, pdl)
    return {"split_only": timed(split), "merge_only": timed(lambda: merge_partials(ws, out, hkv, splits, pdl)),
            "split_merge": timed(both)}


MERGE_VARIANTS = {"merge_w1": {"merge_warps": 1}, "merge_w2": {"merge_warps": 2}, "merge_w4": {"merge_warps": 4},
                  "fused_merge": {"fuse": True},
                  # every kernel's step inputs loaded after its PDL wait, and the merge's successor launched at
                  # its exit (the default: inputs before the wait, the successor after the merge's wait)
                  "no_pre_wait": {"pre_wait": False}}


def merge_rows(c, sel, idx, splits: int, base: dict) -> list[dict]:
    """The attention, and the whole step, with each way of merging the split partials
    (max_abs_diff: against the decoder's launch, bench attention's `attend`)."""
    counter = torch.zeros(c.batch * c.k.shape[1], dtype=torch.int32, device="cuda")
    rows = []
    for name, v in MERGE_VARIANTS.items():
        def att(ii):
            return sparse_decode_attention(c.q, c.k, c.v, c.nt, ii, c.kk, c.budget.sinks, c.budget.recent,
                                           splits=splits, block_n=ATTN_CFG["block_n"], pdl=sel.pdl,
                                           merge_counter=counter if v.get("fuse") else None,
                                           merge_warps=v.get("merge_warps", 1), pre_wait=v.get("pre_wait", True))
        ref = attend(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, splits, sel.pdl).clone()
        err = float((att(idx).float() - ref.float()).abs().max())
        rows.append({**base, "method": f"attn_{name}", "time_us": timed(lambda: att(idx)), "max_abs_diff": err})
        sel.pre_wait = v.get("pre_wait", True)
        rows.append({**base, "method": f"step_{name}", "time_us": timed(
            lambda: att(sel.select(c.q, c.tables, c.lo, c.hi, c.kk)))})
    sel.pre_wait = True
    return rows


def off_chain_bound(c, sel, idx, splits: int, base: dict) -> list[dict]:
    """A bound for any design that takes radix pass 1 and the collect off the step's chain:
    route + score (pass 0 included) then the attention over a fixed, already collected index
    list (the default's own selection), chained as the step chains them. No such design selects
    this way; the row says how much time the two launches' place in the chain can be worth."""
    def att():
        return attend(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, splits, sel.pdl)

    def bound():
        sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk)
        att()
    return [{**base, "method": "score_alone", "time_us": timed(lambda: sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk))},
            {**base, "method": "selection_alone", "time_us": timed(lambda: sel.select(c.q, c.tables, c.lo, c.hi, c.kk))},
            {**base, "method": "bound_score_then_attention", "time_us": timed(bound)},
            {**base, "method": "step_default", "time_us": timed(
                lambda: attend(c.q, c.k, c.v, c.nt, sel.select(c.q, c.tables, c.lo, c.hi, c.kk), c.kk, c.budget,
                               splits, sel.pdl))}]


def main(argv: list[str] | None = None) -> int:
    args = gpu_cli("attn_parts_probe", "131072", argv)
    if args is None:
        return 2
    rows, budget = [], Budget()
    for c in cases(args, budget, "int8"):
        base, sel, idx = c.default_selection()
        splits = c.splits
        rows.append({**base, "method": "attention", "splits": splits,
                     "time_us": timed(lambda: attend(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, splits, sel.pdl))})
        rows += off_chain_bound(c, sel, idx, splits, base)
        rows += merge_rows(c, sel, idx, splits, base)
        for ss, bn, w in ((splits, ATTN_CFG["block_n"], 4), (splits, 64, 4), (2 * splits, 64, 4), (splits, 128, 8)):
            for name, t in parts(c, idx, ss, sel.pdl, bn, w).items():
                rows.append({**base, "method": f"{name}_s{ss}_b{bn}_w{w}", "time_us": t})
        flat = idx[..., :c.top_k].reshape(-1, c.top_k).contiguous()
        kf, vf = c.k.flatten(0, 1), c.v.flatten(0, 1)
        for blk in (16, 32, 64, 128):
            nb = -(-c.top_k // blk)
            o = torch.empty(flat.shape[0] * nb * 128, device="cuda")
            rows.append({**base, "method": f"gather_block{blk}", "time_us": timed(
                lambda: _gather_kernel[(flat.shape[0], nb)](kf, vf, flat, o, c.top_k, c.n, D=c.k.shape[-1],
                                                            BLOCK=blk))})
        nbytes = flat.numel() * 2 * 128 * 2
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
        for progs, blk, w in ((132 * 8, 2048, 8), (132 * 4, 8192, 4), (132 * 2, 16384, 8), (132 * 16, 1024, 4)):
            o = torch.empty(progs, device="cuda")
            rows.append({**base, "method": f"stream_p{progs}_b{blk}_w{w}", "bytes": nbytes, "time_us": timed(
                lambda: _stream_kernel[(progs,)](x, o, x.numel(), BLOCK=blk, num_warps=w))})
        y = torch.empty_like(x)
        rows.append({**base, "method": "stream_copy_torch", "bytes": 2 * nbytes, "time_us": timed(lambda: y.copy_(x))})
        print_table(rows[-32:], ["context", "batch", "method", "time_us"])
        del c
    path = write_results("attn_parts_probe", rows, None, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
