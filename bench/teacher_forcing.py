"""Teacher-forced decode through the whole model: the continuation's true tokens are fed one
step at a time with sparse attention, and each step's prediction is compared with full attention."""

from __future__ import annotations

import torch

from ctxcache.decoder import SparseAttention, SparseConfig
from ctxcache.generation import decode_one_token
from ctxcache.methods import SparseMethod, Tables
from ctxcache.models.attention import dense_attention
from ctxcache.models.loader import LoadedModel

from ctxcache.bench.capture import Captured, context_cache


@torch.inference_mode()
def teacher_forced(lm: LoadedModel, ids: list[int], cap: Captured, method: SparseMethod | None,
                   tables: list[Tables] | None, config: SparseConfig) -> dict[str, float]:
    """top1_agreement with full attention and mean NLL of the continuation's next tokens.

    method None runs full attention through the same step-by-step loop (a check that the loop
    itself reproduces the batched dense logits)."""
    n0, cont = cap.n_context, len(ids) - cap.n_context
    cache = context_cache(lm, cap, cont)
    if method is None:
        attn = dense_attention
    else:
        attn = SparseAttention(method, [[method.open(t) for t in tables]], config)
    logits = torch.stack([decode_one_token(lm.model, torch.tensor([ids[n0 + t]]), cache, attn)[0]
                          for t in range(cont - 1)])  # row t predicts token n0 + t + 1
    target = torch.tensor(ids[n0 + 1:])
    ref = cap.logits[:cont - 1]
    nll = torch.nn.functional.cross_entropy(logits, target).item()
    ref_nll = torch.nn.functional.cross_entropy(ref, target).item()
    return {
        "top1_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "nll": nll,
        "nll_delta_pct": 100.0 * (nll - ref_nll) / ref_nll,
        "keys_read_frac_model": attn.keys_read / max(attn.keys_total, 1) if method else 1.0,
    }
