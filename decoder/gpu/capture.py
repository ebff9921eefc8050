"""Capture real Q/K/V + CSAttention tables from the default model on CPU, for the GPU check.

The device cannot load the model (it is not there), so a few layers' post-RoPE tensors at a
few thousand tokens travel as one small file: `python -m ctxcache.decoder.gpu.capture OUT.pt`."""

from __future__ import annotations

import argparse

import torch

from ctxcache.generation import prefill
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.models.attention import QueryCapture
from ctxcache.models.loader import load_model


def capture(n_ctx: int, n_dec: int, layers: list[int], text: str = "prose") -> dict:
    """Prefill n_ctx + n_dec tokens; tables from the first n_ctx; the last n_dec queries are the
    decode queries, each attending over the keys before and at its own position."""
    from ctxcache.bench.texts import builtin_text, tokens_of

    lm = load_model("smollm2")
    ids = torch.tensor([tokens_of(lm.tokenizer, builtin_text(text), n_ctx + n_dec, text)])
    cache = lm.model.new_cache(1, max_len=n_ctx + n_dec)
    cap = QueryCapture(lm.args.n_layers)
    prefill(lm.model, ids, cache, cap, chunk=512)
    method = CSAttention(CSAttentionParams(table_dtype="float16"))  # the check quantizes them for int8
    out = {"n_ctx": n_ctx, "layers": layers, "params": method.params.to_dict(), "data": []}
    for layer in layers:
        q = cap.queries(layer)
        k, v = cache.k[layer][0], cache.v[layer][0]
        tables = method.build(q[:, :n_ctx], k[:, :n_ctx], v[:, :n_ctx])
        out["data"].append({"q_dec": q[:, n_ctx:].clone(), "k": k.clone(), "v": v.clone(), "tables": tables})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxcache.decoder.gpu.capture")
    ap.add_argument("out")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-dec", type=int, default=16)
    ap.add_argument("--layers", default="2,10,20,28")
    args = ap.parse_args(argv)
    torch.save(capture(args.n_ctx, args.n_dec, [int(x) for x in args.layers.split(",")]), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
