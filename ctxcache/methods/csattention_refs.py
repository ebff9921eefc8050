"""CSAttention's torch references that the GPU path matches, beside the estimate: the subspace
split of the head dimension (the selector's layout), the exact re-rank of the candidates
(kernels/rerank.py), the int8-coded keys it may score with, and the promotion of the keys after
the last step's (kernels/follow.py)."""

from __future__ import annotations

from typing import Any

import torch

from ctxcache.kv_codec import KEY_GROUP, dequantize_keys, quantize_keys
from ctxcache.models.attention import select_keys

CODED_MEMO = "rerank_k8"  # a stream's LayerState.extra entry: its decoded whole key groups


def exact_rerank(q: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor, k: int,
                 others: torch.Tensor | None = None, ordered: bool = False) -> torch.Tensor:
    """The k of the candidates cand [Hkv, c] (key indices) with the largest attention probability
    summed over the GQA group: the oracle's criterion over the keys a step reads, the softmax
    normalized over the candidates plus `others` [Hkv, s] (the sinks and recent window, read
    anyway; with every key among them this is the oracle's ranking). q [Hq, D], keys [Hkv, n, D]
    -> [Hkv, min(k, c)] key indices (ordered: best first): the torch reference a GPU re-rank
    must match."""
    hkv, _, d = keys.shape
    read = cand if others is None else torch.cat([cand, others], dim=1)
    kr = select_keys(keys, read).float()  # [Hkv, c + s, D]: torch.gather's values, 3.5x faster on CPU
    logits = torch.einsum("hgd,hcd->hgc", q.float().view(hkv, -1, d), kr) * d ** -0.5
    score = logits.softmax(-1)[..., :cand.shape[1]].sum(1)  # [Hkv, c]
    best = torch.topk(score, min(k, cand.shape[-1]), dim=-1, sorted=ordered).indices
    return torch.gather(cand, 1, best)


def int8_coded_keys(keys: torch.Tensor, memo: dict[str, Any] | None = None) -> torch.Tensor:
    """keys [Hkv, n, D] as the int8 codec stores a cache of n keys, decoded to keys' dtype
    (kv_codec.quantize_keys: per channel per KEY_GROUP tokens from position 0, the last group
    over the keys it has): what the re-rank scores with rerank_k="int8". memo (one stream's
    LayerState.extra): the whole groups decoded by earlier calls, reused; a cache's keys do not
    change, and only the last, partial group's scales move as keys are appended."""
    n = keys.shape[1]
    whole = n // KEY_GROUP * KEY_GROUP
    done = memo.get(CODED_MEMO) if memo is not None else None
    have = 0 if done is None else done.shape[1]
    if have < whole:  # slices start on a group boundary, so their groups are the cache's
        new = _coded(keys[:, have:whole])
        done = new if done is None else torch.cat([done, new], dim=1)
        if memo is not None:
            memo[CODED_MEMO] = done
    parts = [done[:, :whole]] if whole else []
    return torch.cat(parts + [_coded(keys[:, whole:n])], dim=1) if n > whole else parts[0]


def _coded(keys: torch.Tensor) -> torch.Tensor:
    return dequantize_keys(*quantize_keys(keys), keys.dtype)


def promote_successors(rank: torch.Tensor, prev: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """rank [Hkv, n] (fp16_rank's) with the keys right after prev [Hkv, f] (those inside
    [lo, hi)) ranked above every other key: their 16-bit key raised to 0xFFFF, above any real
    score's, and ties among them to the lower index, as the GPU's radix select breaks them (more
    successors than candidates: the lowest win)."""
    succ = prev + 1
    inside = (succ >= lo) & (succ < hi)
    # amax: an index written twice (a clamped successor past the end) stays promoted if any says so
    hit = torch.zeros_like(rank).scatter_reduce(1, succ.clamp(max=rank.shape[1] - 1), inside.long(), "amax")
    return torch.where(hit.bool(), (0xFFFF << 32) + (rank & 0xFFFFFFFF), rank)


def subspace_permutation(head_dim: int, m: int, layout: str) -> torch.Tensor:
    """Order of head dimensions so that view(m, head_dim // m) yields the subspaces.

    rope_pairs keeps each RoPE rotation pair (i, i + D/2) inside one subspace."""
    if head_dim % m or (layout == "rope_pairs" and head_dim % (2 * m)):
        raise ValueError(f"head_dim={head_dim} cannot be split into {m} subspaces ({layout})")
    if layout == "contiguous":
        return torch.arange(head_dim)
    half, per = head_dim // 2, head_dim // (2 * m)
    first = torch.arange(half).view(m, per)
    return torch.cat([first, first + half], dim=1).reshape(-1)
