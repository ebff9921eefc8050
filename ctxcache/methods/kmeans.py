"""Batched k-means in torch (cosine or Euclidean), k-means++ seeding, optional mini-batches.

Shapes carry a leading batch dimension so that every (KV head, subspace) pair of a layer is
clustered in one call: x [B, n, d] -> centroids [B, C, d]. The Lloyd step runs on x's device,
so Multipole's re-clustering and CSAttention's GPU build (methods/csattention_build) share it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ctxcache.cancel import check as check_cancel


def _distances(x: torch.Tensor, c: torch.Tensor, cosine: bool) -> torch.Tensor:
    """[B, n, C]: 1 - cos for cosine (inputs normalised), squared L2 otherwise."""
    if cosine:
        return 1.0 - x @ c.transpose(1, 2)
    return (x.pow(2).sum(-1, keepdim=True) - 2 * x @ c.transpose(1, 2)
            + c.pow(2).sum(-1)[:, None, :]).clamp_min(0)


def nearest(x: torch.Tensor, c: torch.Tensor, cosine: bool) -> torch.Tensor:
    """Index [B, n] of the nearest centroid (cosine: largest dot product, no subtraction pass)."""
    if cosine:
        return (x @ c.transpose(1, 2)).argmax(-1)
    # |x|^2 is the same for every centroid, so it does not change the argmin
    return (c.pow(2).sum(-1)[:, None, :] - 2 * x @ c.transpose(1, 2)).argmin(-1)


def kmeans_pp_init(x: torch.Tensor, n_clusters: int, cosine: bool,
                   gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeds [B, C, d]: each next seed drawn with probability ~ distance to the nearest."""
    # seeding from a subsample costs little quality and makes the C sequential draws cheap
    if x.shape[1] > 16 * n_clusters:
        x = x[:, torch.randperm(x.shape[1], generator=gen)[:16 * n_clusters]]
    b, n, _ = x.shape
    rows = torch.arange(b)
    first = torch.randint(n, (b,), generator=gen)
    centroids = [x[rows, first]]
    nearest = _distances(x, centroids[0][:, None], cosine)[..., 0]
    for _ in range(1, n_clusters):
        check_cancel()  # C sequential draws: minutes at C = 4096 on a CPU
        weights = nearest.clamp_min(0) + 1e-12
        pick = torch.multinomial(weights, 1, generator=gen)[:, 0]
        centroids.append(x[rows, pick])
        nearest = torch.minimum(nearest, _distances(x, centroids[-1][:, None], cosine)[..., 0])
    return torch.stack(centroids, dim=1)


def lloyd_step(x: torch.Tensor, cent: torch.Tensor, cosine: bool) -> torch.Tensor:
    """One full-batch Lloyd iteration on x's device: x [B, n, d] (unit rows if cosine), cent
    [B, C, d] -> new centroids (member means, unit if cosine; a centroid with no member stays)."""
    assign = nearest(x, cent, cosine)
    b, c, d = cent.shape
    sums = torch.zeros_like(cent).scatter_add_(1, assign[..., None].expand(-1, -1, d), x)
    hits = x.new_zeros(b, c).scatter_add_(1, assign, torch.ones_like(x[..., 0]))
    cent = torch.where(hits[..., None] > 0, sums / hits.clamp_min(1)[..., None], cent)
    return F.normalize(cent, dim=-1) if cosine else cent


def lloyd(x: torch.Tensor, cent: torch.Tensor, iters: int, cosine: bool = False) -> torch.Tensor:
    """Lloyd iterations from given centroids: x [B, n, d], cent [B, C, d] -> assignment [B, n]."""
    for _ in range(iters):
        check_cancel()
        cent = lloyd_step(x, cent, cosine)
    return nearest(x, cent, cosine)


def kmeans(x: torch.Tensor, n_clusters: int, iters: int = 10, cosine: bool = True,
           batch_size: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster x [B, n, d]; -> (centroids [B, C, d], assignment [B, n] of the full x).

    With batch_size < n, each iteration updates centroids from a random mini-batch with
    per-centroid learning rates 1/count (Sculley 2010); otherwise it is Lloyd's algorithm.
    """
    x = x.float()
    if cosine:
        x = F.normalize(x, dim=-1)
    b, n, d = x.shape
    c_eff = min(n_clusters, n)
    gen = torch.Generator().manual_seed(seed)
    cent = kmeans_pp_init(x, c_eff, cosine, gen)
    counts = torch.zeros(b, c_eff)
    for _ in range(iters):
        check_cancel()  # a build's cancellation or time bound, between iterations
        if batch_size is None or batch_size >= n:
            cent = lloyd_step(x, cent, cosine)
            continue
        xb = x[:, torch.randperm(n, generator=gen)[:batch_size]]
        assign = nearest(xb, cent, cosine)  # [B, nb]
        sums = torch.zeros(b, c_eff, d).scatter_add_(1, assign[..., None].expand(-1, -1, d), xb)
        hits = torch.zeros(b, c_eff).scatter_add_(1, assign, torch.ones_like(assign, dtype=torch.float))
        counts += hits
        rate = (hits / counts.clamp_min(1))[..., None]
        means = sums / hits.clamp_min(1)[..., None]
        cent = torch.where(hits[..., None] > 0, (1 - rate) * cent + rate * means, cent)
        if cosine:
            cent = F.normalize(cent, dim=-1)
    if c_eff < n_clusters:  # fewer points than clusters: repeat the last centroid (never nearest-unique)
        cent = torch.cat([cent, cent[:, -1:].expand(-1, n_clusters - c_eff, -1)], dim=1)
    return cent, nearest(x, cent, cosine)
