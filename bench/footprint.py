"""`ctxcache bench footprint`: mass recall against resident index bytes, over CSAttention's
centroids C, subspaces m and row bits, on both texts.

The resident index is what a decode step reads besides the K/V: the dense rows (one per head,
subspace and centroid, every key's score at `bits` bits plus an fp32 scale) and the fp16
centroids. Its size is reported against the fp16 K/V at SmolLM2's shapes (head_dim 64) and at
head_dim 128 (Llama-3.1-8B: the same rows, twice the K/V per token). Mass recall is measured on
SmolLM2 (dense capture of --tokens + --continuation tokens, every --layer-step-th layer, the
selection's mass over the true top-K's; quality/selection.py). Rows of fewer than 8 bits
are the int8 rows rounded to 2^(bits-1) - 1 levels per row (the same integer estimate).
Writes <out>/footprint_<device>.json and .png and prints the table with the Pareto front marked.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from ctxcache.methods import Budget, make_method
from ctxcache.methods.csattention_rows import dense_row_bytes
from ctxcache.methods.int8_tables import quantize_rows
from ctxcache.models.loader import DEFAULT_MODEL, load_model

from ctxcache.quality.capture import Captured, build_tables, capture
from ctxcache.bench.common.report import device_tag, parse_text_args, plot_lines, print_table, write_result
from ctxcache.quality.selection import selection_metrics
from ctxcache.quality.texts import builtin_text, tokens_of

COLUMNS = ["text", "centroids", "subspaces", "bits", "mass_recall", "index_over_kv", "index_over_kv_hd128", "pareto"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ctxcache bench footprint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--texts", default="prose,code")
    ap.add_argument("--text", default="prose", help=argparse.SUPPRESS)  # checked by parse_text_args
    ap.add_argument("--centroids", default="16,32,64,128")
    ap.add_argument("--subspaces", default="4,8,16")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--keep", type=float, default=0.05)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--layer-step", type=int, default=3, help="score every layer-step-th layer")
    return parse_text_args(ap, argv, 2)


def index_over_kv(n: int, hkv: int, head_dim: int, m: int, c: int, bits: int) -> float:
    """Resident index bytes (rows at `bits` bits + fp32 row scales + fp16 centroids) over the
    fp16 K/V bytes of one layer of n tokens."""
    rows = dense_row_bytes(n, hkv, m, c, int8=True) - hkv * m * c * n * (8 - bits) // 8
    return (rows + hkv * m * c * (head_dim // m) * 2) / (2 * hkv * n * head_dim * 2)


def with_bits(tables: dict, bits: int) -> dict:
    """fp16-row tables -> rows rounded to `bits` bits (int8 storage, per-row scale)."""
    dense, scale = quantize_rows(tables["dense_score"], bits)
    return {**tables, "dense_score": dense, "dense_scale": scale}


def text_rows(lm, text: str, args: argparse.Namespace) -> list[dict]:
    ids = tokens_of(lm.tokenizer, builtin_text(text), args.tokens + args.continuation, text)
    full = capture(lm, ids, args.tokens)
    layers = list(range(0, lm.args.n_layers, args.layer_step))
    cap = Captured(full.n_context, *([getattr(full, f)[l] for l in layers] for f in ("q", "k", "v")), None)
    a, budget, rows = lm.args, Budget(args.keep), []
    grid = itertools.product(_ints(args.centroids), _ints(args.subspaces))
    for c, m in grid:
        method = make_method("csattention", {"centroids": c, "subspaces": m, "table_dtype": "float16"})
        fp16 = build_tables(method, cap)
        for bits in _ints(args.bits):
            scored = make_method("csattention", {"centroids": c, "subspaces": m})  # int8 arithmetic
            recall = selection_metrics(scored, [with_bits(t, bits) for t in fp16], cap, budget, args.stride)["mass_recall"]
            rows.append({"text": text, "centroids": c, "subspaces": m, "bits": bits, "mass_recall": recall,
                         "index_over_kv": index_over_kv(args.tokens, a.n_kv_heads, a.head_dim, m, c, bits),
                         "index_over_kv_hd128": index_over_kv(args.tokens, a.n_kv_heads, 128, m, c, bits)})
            print(f"[footprint] {text} C={c} m={m} {bits}-bit: {recall:.4f}", file=sys.stderr, flush=True)
    return rows


def mark_pareto(rows: list[dict]) -> None:
    """Per text: a point is on the front when no other has at most its bytes and more recall."""
    for r in rows:
        r["pareto"] = not any(o["text"] == r["text"] and o["index_over_kv"] <= r["index_over_kv"]
                              and o["mass_recall"] > r["mass_recall"] for o in rows)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    lm = load_model(args.model)
    try:
        rows = [r for text in args.texts.split(",") for r in text_rows(lm, text, args)]
    except ValueError as e:
        print(f"ctxcache bench footprint: error: {e}", file=sys.stderr)
        return 2
    mark_pareto(rows)
    print(f"model={lm.model_id} tokens={args.tokens} keep={args.keep} layers every {args.layer_step}")
    print_table(rows, COLUMNS)
    payload = {"model": lm.model_id, "tokens": args.tokens, "keep": args.keep, "layer_step": args.layer_step,
               "rows": rows}
    path = write_result("footprint", payload, args.out)
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault(f"{r['text']} {r['bits']}-bit m={r['subspaces']}", []).append(
            (r["index_over_kv_hd128"], r["mass_recall"]))
    plot_lines(Path(args.out) / f"footprint_{device_tag()}.png", series,
               "resident index bytes / fp16 K/V bytes at head_dim 128 (C = 16..128 along each line)",
               "mass recall", "CSAttention: recall vs resident index (SmolLM2)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
