"""CSAttention's torch references that the GPU path matches, beside the estimate: the subspace
split of the head dimension (the selector's layout), the exact re-rank of the candidates
(kernels/rerank.py) and the promotion of the keys after the last step's (kernels/follow.py)."""

from __future__ import annotations

import torch

from ctxcache.models.attention import select_keys


def exact_rerank(q: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor, k: int,
                 others: torch.Tensor | None = None, ordered: bool = False,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
    """The k of the candidates cand [Hkv, c] (key indices) with the largest attention probability
    summed over the GQA group: the oracle's criterion over the keys a step reads, the softmax
    normalized over the candidates plus `others` [Hkv, s] (the sinks and recent window, read
    anyway; with every key among them this is the oracle's ranking). q [Hq, D], keys [Hkv, n, D]
    -> [Hkv, min(k, c)] key indices (ordered: best first): the torch reference a GPU re-rank
    must match. valid [Hkv, c]: False marks padding (neither normalized over nor chosen while
    k valid candidates remain)."""
    hkv, _, d = keys.shape
    read = cand if others is None else torch.cat([cand, others], dim=1)
    kr = select_keys(keys, read).float()  # [Hkv, c + s, D]: torch.gather's values, 3.5x faster on CPU
    logits = torch.einsum("hgd,hcd->hgc", q.float().view(hkv, -1, d), kr) * d ** -0.5
    if valid is not None:
        pad = torch.zeros(hkv, read.shape[1], dtype=torch.bool)
        pad[:, :cand.shape[1]] = ~valid
        logits = logits.masked_fill(pad[:, None], float("-inf"))
    score = logits.softmax(-1)[..., :cand.shape[1]].sum(1)  # [Hkv, c]
    if valid is not None:
        score = score.masked_fill(~valid, -1.0)
    best = torch.topk(score, min(k, cand.shape[-1]), dim=-1, sorted=ordered).indices
    return torch.gather(cand, 1, best)


def carried_candidates(extra: dict, lo: int, hi: int, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """reselect's candidates on a step between the estimate's: the previous step's selection
    extra["chosen_prev"] [Hkv, K], the successors of its best keys (extra["follow_prev"]) and the
    keys that entered [lo, hi) since extra["chosen_hi"] (the region's end moves a key a step), those
    inside [lo, hi), distinct, in key order -> (indices [Hkv, c], valid [Hkv, c]: rows with fewer
    candidates padded with their first); None where a row has fewer than k (select afresh)."""
    prev = extra["chosen_prev"]
    hkv = prev.shape[0]
    parts = [prev, torch.arange(extra["chosen_hi"], hi).expand(hkv, -1)]
    if "follow_prev" in extra:
        parts.append(extra["follow_prev"] + 1)
    every = torch.cat(parts, dim=1)
    inside = (every >= lo) & (every < hi)
    member = torch.zeros(hkv, hi + 1, dtype=torch.bool)  # column hi: where the outside ones land
    member.scatter_(1, torch.where(inside, every, hi), True)
    member = member[:, :hi]
    counts = member.sum(1)
    if int(counts.min()) < k:
        return None
    order = torch.sort(member.to(torch.uint8), dim=1, descending=True, stable=True).indices
    cand = order[:, :int(counts.max())]
    valid = torch.arange(cand.shape[1]) < counts[:, None]
    return torch.where(valid, cand, cand[:, :1]), valid


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
