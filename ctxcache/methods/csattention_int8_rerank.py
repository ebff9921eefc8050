"""CSAttention's second stage over int8 keys (`rerank_keys="int8"`, a lever of issue 31).

The estimate proposes ceil(rerank * K) candidates; the re-rank scores them against the keys as
the int8 K/V codec stores them (kv_codec: per channel, groups of KEY_GROUP tokens, fp16 scales)
instead of fp16 keys, so a candidate costs D + D/64 bytes instead of 2D and about 1.9x the
candidates fit in the same bytes; the K keys it keeps are then read in fp16 for the attention.
Why: fewer candidates lose more answers (issue 31: rerank 1 < 2 < 4 < the oracle), so the
lever buys candidates with bytes the exact fp16 re-rank spent on precision.

The dequantized keys of complete token groups are cached per stream and layer (LayerState.extra)
and only the last, growing group is quantized each step: the codec's groups start at token 0,
so the cached groups are what the stored codes decode to, bit for bit.
"""

from __future__ import annotations

import torch

from ctxcache.kv_codec import KEY_GROUP, int8_keys
from ctxcache.methods.base import LayerState
from ctxcache.models.attention import select_keys

_KEY = "int8_keys"


def int8_key_rows(state: LayerState, keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx [Hkv, c] of the int8-coded keys [Hkv, n, D] (dequantized, fp32) -> [Hkv, c, D]."""
    n = keys.shape[1]
    full = n // KEY_GROUP * KEY_GROUP
    done = state.extra.get(_KEY)
    if done is None or done.shape[1] < full:
        state.extra[_KEY] = done = int8_keys(keys[:, :full])
    tail = int8_keys(keys[:, full:n]) if n > full else done[:, :0]
    head_rows = select_keys(done, idx.clamp(max=max(full - 1, 0))) if full else None
    if tail.shape[1] == 0:
        return head_rows
    tail_rows = select_keys(tail, (idx - full).clamp(min=0))
    if head_rows is None:
        return tail_rows
    return torch.where((idx < full)[..., None], head_rows, tail_rows)


def rerank_from_rows(q: torch.Tensor, kr: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """exact_rerank's criterion over given key rows kr [Hkv, c + s, D] whose first c rows are the
    candidates cand [Hkv, c] (the rest: sinks and recent window) -> [Hkv, min(k, c)] indices."""
    hkv, _, d = kr.shape
    logits = torch.einsum("hgd,hcd->hgc", q.float().view(hkv, -1, d), kr.float()) * d ** -0.5
    score = logits.softmax(-1)[..., :cand.shape[1]].sum(1)
    best = torch.topk(score, min(k, cand.shape[-1]), dim=-1, sorted=False).indices
    return torch.gather(cand, 1, best)


def int8_candidate_bytes(candidates: int, head_dim: int) -> int:
    """Bytes of one KV head's int8-coded K for `candidates` keys (codes and fp16 scale share)."""
    return candidates * head_dim + -(-candidates * head_dim * 2 // KEY_GROUP)
