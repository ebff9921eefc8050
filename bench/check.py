"""`ctxcache bench check`: the GPU fast path against the torch reference path (correctness, not speed).

1. Real Q/K/V captured from the default model on a CPU machine (`ctxcache bench check --capture
   FILE` writes it; the GPU machine has no model) and read with --captured FILE: per decode
   query, the GPU selection vs CSAttention.select (overlap of the searched middle) and the
   GPU attention output vs gather_attention (relative L2 error).
2. A random-weight model: 64 greedy tokens from the GPU graph decode vs the CPU reference
   decode loop (decoder.session.generate), same artifact.
Both for fp16 and for int8 dense tables at rerank 1 (CSAttention table_dtype, results under
"*_int8"); (2) also at the defaults (rerank 4, follow 128: "*_defaults").
Prints one row per variant, writes <out>/check_<device>.json."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ctxcache.decoder.gpu.attention import GpuSparseAttention
from ctxcache.decoder.gpu.graph import GraphDecoder
from ctxcache.decoder.gpu.selector import GpuSelector
from ctxcache.decoder.gpu.table_stacks import stack_tables
from ctxcache.kernels.split_k_attention import region, sparse_decode_attention
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.methods.int8_tables import int8_dense_tables
from ctxcache.models.attention import gather_attention

from ctxcache.bench.common.report import add_out, print_table, write_result


def _overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    return len(set(got.tolist()) & set(want.tolist())) / max(1, want.numel())


def _tie_overlap(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> float:
    """Overlap counting a key the GPU picked instead of a reference key as agreeing when its
    reference score ties the reference's K-th score within one fp16 step (the GPU ranks
    fp16-rounded scores, summed in another order)."""
    kth = float(scores[want].min())
    ulp = max(abs(kth), 2.0 ** -14) * 2.0 ** -10
    extra = [i for i in set(got.tolist()) - set(want.tolist()) if float(scores[i]) >= kth - ulp]
    return min(1.0, (len(set(got.tolist()) & set(want.tolist())) + len(extra)) / max(1, want.numel()))


def check_captured(path: str, device: str, budget: Budget = Budget(), table_dtype: str = "float16") -> list[dict]:
    blob = torch.load(path, weights_only=False)
    params = CSAttentionParams(**{**blob["params"], "table_dtype": table_dtype})
    method, n_ctx, rows = CSAttention(params), blob["n_ctx"], []
    for layer, d in zip(blob["layers"], blob["data"]):
        q_dec, k, v = d["q_dec"], d["k"], d["v"]
        hq, n_dec, hd = q_dec.shape
        hkv = k.shape[0]
        tables = int8_dense_tables(d["tables"]) if params.int8_tables else d["tables"]
        state = method.open(tables)
        gt = stack_tables([tables], [n_ctx], n_dec, device)
        sel = GpuSelector(params, 1, hq, hkv, hd, k.shape[1], budget.top_k(k.shape[1]), device)
        for j in range(n_dec):
            n = n_ctx + j + 1
            method.append(state, k[:, n - 1:n], n - 1)
            gt.insert(k[None, :, n - 1].to(device), torch.tensor([n - 1], dtype=torch.int32, device=device), sel.perm)
            q = q_dec[:, j]
            ref_idx = method.select(state, q, k, n, budget)
            ref_out = gather_attention(q.double(), k[:, :n].double(), v[:, :n].double(), ref_idx)
            nt = torch.tensor([n], dtype=torch.int32, device=device)
            lo, hi = region(nt, budget.sinks, budget.recent)
            kk = torch.tensor([budget.top_k(n)], dtype=torch.int32, device=device)
            idx = sel.select(q[None].to(device), gt, lo, hi, kk)
            n_static = int(lo[0]) + n - int(hi[0])
            scores = method._combine(method.estimate(state, q, n), hd)  # [Hkv, n] the reference ranking
            row = {"layer": layer, "step": j, "n": n}
            got = [idx[0, h, :int(kk[0])].cpu() for h in range(hkv)]
            row["overlap"] = min(_overlap(got[h], ref_idx[h, n_static:]) for h in range(hkv))
            row["tie_overlap"] = min(_tie_overlap(got[h], ref_idx[h, n_static:], scores[h]) for h in range(hkv))
            for dt in (torch.float32, torch.bfloat16):
                kc, vc = k[None, :, :n].to(device, dt), v[None, :, :n].to(device, dt)
                out = sparse_decode_attention(q[None].to(device, dt), kc, vc, nt, idx, kk,
                                              budget.sinks, budget.recent, splits=4)[0].double().cpu()
                row[f"rel_err_{str(dt)[6:]}"] = ((out - ref_out).norm() / ref_out.norm()).item()
            rows.append(row)
    return rows


def check_greedy(device: str, steps: int = 64, n_ctx: int = 900, table_dtype: str = "float16",
                 rerank: float = 1.0) -> dict:
    """rerank > 1: with the exact re-rank and the default follow (their GPU kernels too)."""
    from ctxcache.decoder.session import generate, restore_tables
    from ctxcache.decoder.reference_attention import SparseConfig
    from ctxcache.generation import SamplingParams
    from ctxcache.indexer.build import IndexerConfig, build_artifact
    from ctxcache.models.loader import load_model

    lm = load_model("random:tiny", seed=3)
    tokens = torch.randint(0, lm.args.vocab_size, (n_ctx,), generator=torch.Generator().manual_seed(0))
    method = CSAttention(CSAttentionParams(table_dtype=table_dtype, rerank=rerank))
    art = build_artifact(lm, tokens, method, IndexerConfig(kv_dtype="float32", progress=False))
    budget = Budget()
    ref = torch.stack([t for t, _ in generate(lm, [art], [[]], SamplingParams(max_tokens=steps),
                                               SparseConfig(budget=budget))], dim=1)[0]
    model = lm.model.to(device)
    cache = model.new_cache(1, max_len=n_ctx + steps)
    cache.load_row(0, [l.k for l in art.layers], [l.v for l in art.layers])
    a = lm.args
    # the rows derived on the device, as the GPU runner derives them at load
    tables = [stack_tables([t], [n_ctx], steps, device) for t in restore_tables(method, art, device)]
    attn = GpuSparseAttention(method.params, tables, budget, 1, a.n_heads, a.n_kv_heads, a.head_dim,
                              cache.max_len)
    dec = GraphDecoder(model, cache, attn)
    logits = [art.last_logits.to(device)[None].float()]
    for _ in range(steps - 1):  # GraphDecoder.greedy, keeping each step's logits
        logits.append(dec.step(logits[-1].argmax(-1)).clone())
    got = torch.stack([l.argmax(-1) for l in logits], dim=1)[0].cpu()
    out = {"steps": steps, "n_ctx": n_ctx, "identical": bool((got == ref).all()),
           "first_mismatch": int((got != ref).nonzero()[0, 0]) if (got != ref).any() else None,
           "ref": ref.tolist(), "gpu": got.tolist()}
    if out["first_mismatch"] is not None:
        # a near-tie shows as a tiny gap between the two tokens' logits on the GPU side
        lg = logits[out["first_mismatch"]][0]
        i = out["first_mismatch"]
        out["logit_gap_at_mismatch"] = float(lg[int(got[i])] - lg[int(ref[i])])
        out["logit_std_at_mismatch"] = float(lg.std())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--captured", default=".carry/smollm2_qkv.pt", help="Q/K/V file from --capture (skipped if absent)")
    ap.add_argument("--capture", default=None, metavar="FILE",
                    help="instead of checking: capture real Q/K/V + tables from the default model into FILE (CPU)")
    ap.add_argument("--n-ctx", type=int, default=2048, help="with --capture: context tokens")
    ap.add_argument("--n-dec", type=int, default=16, help="with --capture: decode queries after the context")
    ap.add_argument("--layers", default="2,10,20,28", help="with --capture: comma-separated layers")
    add_out(ap)
    args = ap.parse_args(argv)
    if args.capture:
        from ctxcache.quality.capture import check_capture
        Path(args.capture).parent.mkdir(parents=True, exist_ok=True)
        torch.save(check_capture(args.n_ctx, args.n_dec, [int(x) for x in args.layers.split(",")]), args.capture)
        print(f"wrote {args.capture}")
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result, table = {}, []
    # the dense tables' storage at rerank 1 (the selector alone), then the defaults (int8 tables,
    # rerank 4, follow 128: the re-rank and follow kernels too)
    for dtype, tag, rerank in (("float16", "", 1.0), ("int8", "_int8", 1.0), ("int8", "_defaults", 4.0)):
        row = {"tables": dtype if rerank == 1.0 else "defaults"}
        if Path(args.captured).exists() and rerank == 1.0:
            rows = check_captured(args.captured, device, table_dtype=dtype)
            result["captured" + tag] = got = {
                "min_overlap": min(r["overlap"] for r in rows),
                "mean_overlap": sum(r["overlap"] for r in rows) / len(rows),
                "min_tie_overlap": min(r["tie_overlap"] for r in rows),
                "mean_tie_overlap": sum(r["tie_overlap"] for r in rows) / len(rows),
                "max_rel_err_float32": max(r["rel_err_float32"] for r in rows),
                "max_rel_err_bfloat16": max(r["rel_err_bfloat16"] for r in rows), "rows": rows}
            row.update({k: v for k, v in got.items() if k != "rows"})
        result["greedy" + tag] = greedy = check_greedy(device, table_dtype=dtype, rerank=rerank)
        same = sum(a == b for a, b in zip(greedy["ref"], greedy["gpu"]))
        row.update(greedy_identical=greedy["identical"], greedy_same=f"{same}/{greedy['steps']}",
                   first_mismatch=greedy["first_mismatch"])
        table.append(row)
    print_table(table, ["tables", "min_overlap", "mean_tie_overlap", "max_rel_err_float32", "max_rel_err_bfloat16",
                        "greedy_identical", "greedy_same", "first_mismatch"])
    print(f"wrote {write_result('check', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
