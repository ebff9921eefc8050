"""`ctxcache bench spec_hit_probe`: how often the threshold bin carried from the previous
step is the current one (kernels/spec_select's guess), on a real model (CPU reference runner).

Why: the speculated pass 1 saves the pass over every key's score only where the K-th candidate's
top byte (d0: sign, exponent and 2 mantissa bits of its fp16 score, a quarter octave) is what it
was at the same layer and KV head one step before. The selection is the same either way; the hit
rate decides the time. Per decode step and (layer, KV head) this records d0 exactly as the GPU
selector's walk finds it (fp16 keys of the combined estimate, follow's successors promoted, the
candidate count c = rerank x K), then counts hits of the previous step's d0 (what the kernel
uses) and, for comparison, of a window of +-1 bin around it and of the last d0 moved as far as
the layer below moved this step. Layer 0 is left out of the rates (it has no layer below)."""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from ctxcache.bench.common.report import add_out, write_result
from ctxcache.bench.common.texts import builtin_text, text_of_tokens

QUESTION = "What does the text say about the keeper of the light?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench spec_hit_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(ap)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--texts", default="prose,code")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)

    from ctxcache.decoder import SparseConfig
    from ctxcache.decoder.runner import ReferenceRunner
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.methods import csattention as cs
    from ctxcache.methods.budget import fp16_rank
    from ctxcache.models.loader import load_model

    seen: dict[int, list[torch.Tensor]] = defaultdict(list)  # layer state -> d0 [Hkv] per step
    original = cs.CSAttention.search

    def search(self, state, q, keys, lo, hi, k):
        c = self.params.candidates(k, hi - lo)
        rank = fp16_rank(self._combine(self.estimate(state, q, n=keys.shape[1]), q.shape[-1]))
        if self.params.follows and c > k and "follow_prev" in state.extra:
            rank = cs._promote_successors(rank, state.extra["follow_prev"], lo, hi)
        kth = torch.topk(rank[:, lo:hi], c, dim=-1).values[:, -1]  # the c-th largest, per KV head
        seen[id(state)].append(((kth >> 32) & 0xFFFF) >> 8)
        return original(self, state, q, keys, lo, hi, k)

    cs.CSAttention.search = search
    lm = load_model(args.model)
    runner = ReferenceRunner(lm)
    method = make_method("csattention")
    prompt = lm.tokenizer.encode(QUESTION)
    rows = []
    for text in args.texts.split(","):
        seen.clear()
        context = lm.tokenizer.encode(text_of_tokens(lm.tokenizer, builtin_text(text), args.tokens))[:args.tokens]
        art = build_artifact(lm, context, method, IndexerConfig(kv_dtype="float16", coded_kv=True))
        row, first = runner.admit("probe", art, prompt, SparseConfig.from_schedule("0.05-step-1"), args.steps + 2)
        token = int(first.argmax())
        for _ in range(args.steps):
            token = int(runner.step([row], [token])[0].argmax())
        runner.release(row) if hasattr(runner, "release") else None
        d0 = torch.stack([torch.stack(v) for v in seen.values() if len(v) > 1])  # [layers, steps, Hkv]
        prev, cur = d0[1:, :-1], d0[1:, 1:]  # layers >= 1 (the layer-delta guess needs the layer below)
        # the same layer's last d0, moved as much as the layer below moved this step (layers run
        # in order, so its collect has stored this step's d0 when this layer's score kernel runs)
        moved = prev + (d0[:-1, 1:] - d0[:-1, :-1])
        rows.append({"text": text, "context_tokens": art.n_tokens, "steps": int(cur.shape[1]),
                     "layers": int(d0.shape[0]), "kv_heads": int(d0.shape[2]),
                     "hit_rate": float((prev == cur).float().mean()),
                     "hit_rate_layer_delta": float((moved == cur).float().mean()),
                     "hit_rate_window3": float(((prev - cur).abs() <= 1).float().mean()),
                     "hit_rate_per_layer": [round(float(x), 3) for x in (prev == cur).float().mean((1, 2))],
                     "d0": d0.tolist()})
        print({k: v for k, v in rows[-1].items() if k not in ("hit_rate_per_layer", "d0")}, flush=True)
    print(f"wrote {write_result('spec_hit_probe', {'args': vars(args), 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
