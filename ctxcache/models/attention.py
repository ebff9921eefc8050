"""Attention callables for the model: dense (causal SDPA) and a capturing wrapper for indexing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ctxcache.models.kv_cache import KVCache


def dense_attention(layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [B, Hq, T, D] over every cached key at or before its position."""
    span = int(pos.max()) + 1
    k, v = cache.k[layer][:, :, :span], cache.v[layer][:, :, :span]
    if q.shape[2] == 1 and q.shape[0] == 1 and q.device.type == "cpu":  # GPUs: as measured there
        return one_query_attention(q, k, v)
    return causal_attention(q, k, v, pos)


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """causal_attention for one row's one query (a decode step), which sees every key of the
    span: no mask tensor to build and read. Why: a boolean [1, 1, 1, S] mask per layer and
    step cost the CPU step its arange, compare and the mask's read (30 layers at 4K tokens)."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), enable_gqa=True)


def appended_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D] at the last T of the S positions of k, v [B, Hkv, S, D] (rows of one
    length): each query sees the keys at or before its own position. Lower-right causal, so no
    mask tensor and no host sync: a question appended to a 32K context took 690 us a layer
    through SDPA with a boolean [T, S] mask on the H100 (cuDNN), where the K/V read is ~45 us."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype),
                                          attn_mask=causal_lower_right(q.shape[2], k.shape[2]), enable_gqa=True)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D] over keys k, v [B, Hkv, S, D] at positions 0..S-1: each query sees the
    keys at or before its position pos [B, T]."""
    span = k.shape[2]
    keys = torch.arange(span, device=q.device)
    mask = keys[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                          enable_gqa=True)


class QueryCapture:
    """Dense attention that also keeps each layer's post-RoPE queries (row 0) for indexing, on
    the model's device and in its dtype: a GPU build reads them there (copying every query of a
    32K context to the host in fp32 was most of PutContext's time on an H100).

    `keep` (sorted positions, or None for all) bounds what is kept: every query of a 128K
    context is 34 GB at Llama-3.1-8B shapes, while the builds read a few thousand positions
    (CSAttention samples max_queries, CTkvr reads the newest). Chunks arrive in order per layer,
    so each chunk's kept columns are found on the host from a running offset: no device sync."""

    def __init__(self, n_layers: int, dtype: torch.dtype | None = None, keep: torch.Tensor | None = None) -> None:
        self.chunks: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.dtype = dtype  # None: the model's
        self.keep = None if keep is None else keep.cpu().long()
        self._seen = [0] * n_layers  # positions of each layer's chunks so far
        self._columns: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        start, t = self._seen[layer], q.shape[2]
        self._seen[layer] += t
        kept = q[0] if self.keep is None else q[0][:, self._kept_columns(start, t, q.device)]
        self.chunks[layer].append(kept if self.dtype is None else kept.to(self.dtype))
        return dense_attention(layer, q, cache, pos)

    def _kept_columns(self, start: int, t: int, device: torch.device) -> torch.Tensor:
        key = (start, t, device)
        if key not in self._columns:
            lo, hi = torch.searchsorted(self.keep, torch.tensor([start, start + t])).tolist()
            self._columns[key] = (self.keep[lo:hi] - start).to(device)
        return self._columns[key]

    def queries(self, layer: int) -> torch.Tensor:
        """The kept queries of a layer, [Hq, N or len(keep), D], in position order."""
        return torch.cat(self.chunks[layer], dim=1)


def select_keys(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [H, n, D] (a cache slice: rows of D contiguous values), idx [H, K] long -> [H, K, D]
    with out[h, j] = x[h, idx[h, j]]: the values torch.gather copies, in one index_select.
    Why: on CPU torch.gather with an expanded index ran 3.5x slower than index_select, and a
    select per head costs a dispatch each (a 4K decode step makes thousands of them)."""
    h, _, d = x.shape
    if x.stride(2) == 1 and x.stride(1) == d and x.stride(0) % d == 0 and h > 0:
        # every head's rows sit in one strided storage: view it as [rows, D] (no copy; the
        # rows between heads, a cache's unused tail, are never indexed)
        head = x.stride(0) // d
        flat = x.as_strided(((h - 1) * head + x.shape[1], d), (d, 1))
        offsets = torch.arange(0, h * head, head, device=idx.device)[:, None]
        return flat.index_select(0, (idx + offsets).flatten()).view(h, idx.shape[1], d)
    return torch.stack([x[i].index_select(0, idx[i]) for i in range(h)])


def gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
    """Reference sparse decode attention (one query per head, shared selection per KV head).

    q [Hq, D]; k, v [Hkv, N, D]; idx [Hkv, K] long; valid [Hkv, K] bool or None -> [Hq, D].
    """
    hkv, d = k.shape[0], k.shape[-1]
    g = q.shape[0] // hkv
    ks = select_keys(k, idx).to(q.dtype)  # [Hkv, K, D]
    vs = select_keys(v, idx).to(q.dtype)
    scores = torch.einsum("hgd,hkd->hgk", q.view(hkv, g, d), ks) * d ** -0.5
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("hgk,hkd->hgd", probs, vs).reshape(hkv * g, d)
