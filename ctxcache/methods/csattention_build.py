"""CSAttention table build on the GPU: batched cosine k-means + tables, all device-resident.

Same algorithm as ctxcache.methods.kmeans (k-means++ seeding from a subsample of 16 C points,
Lloyd iterations: its lloyd_step, shared) and CSAttention.build (group-sum or per-head queries,
dense rows of every key's score or Top-L lists), but with every tensor on the input's device
and the random draws from a device generator. Only the seeding is its own: the C - 1
sequential seed draws are the launch-bound part (measured 32 ms per layer on the H100 with
torch.multinomial over all 4096 sampled queries), so each draw is an inverse-CDF lookup
(cumsum + searchsorted) over the subsample; the CPU build keeps torch.multinomial on a CPU
generator, so its tables (and the stored artifacts' seeds) stay as they were. Not
bit-identical to the CPU build (other random streams); the tests check tables against torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ctxcache.kernels.quantize import quantize_rows_fused
from ctxcache.methods.csattention_params import CSAttentionParams
from ctxcache.methods.int8_tables import int8_dense_tables
from ctxcache.cancel import check as check_cancel
from ctxcache.methods.kmeans import lloyd_step


def kmeans_pp_seeds(x: torch.Tensor, n_clusters: int, gen: torch.Generator) -> torch.Tensor:
    """Cosine k-means++ seeds [B, C, d] of unit rows x [B, n, d], drawn from a subsample of
    16 C points (as ctxcache.methods.kmeans does)."""
    b, n, _ = x.shape
    if n > 16 * n_clusters:
        x = x[:, torch.randperm(n, device=x.device, generator=gen)[:16 * n_clusters]]
        n = x.shape[1]
    rows = torch.arange(b, device=x.device)
    cent = [x[rows, torch.randint(n, (b,), device=x.device, generator=gen)]]
    nearest = 1.0 - (x @ cent[0][..., None])[..., 0]
    draws = torch.rand(b, n_clusters, 1, device=x.device, generator=gen)
    for i in range(1, n_clusters):
        check_cancel()
        cdf = torch.cumsum(nearest.clamp_min(0) + 1e-12, dim=1)
        pick = torch.searchsorted(cdf, draws[:, i] * cdf[:, -1:]).clamp_max(n - 1)[:, 0]
        cent.append(x[rows, pick])
        nearest = torch.minimum(nearest, 1.0 - (x @ cent[-1][..., None])[..., 0])
    return torch.stack(cent, dim=1)


def kmeans_gpu(x: torch.Tensor, n_clusters: int, iters: int, seed: int = 0) -> torch.Tensor:
    """Cosine k-means of x [B, n, d] (n >= n_clusters) -> unit centroids [B, C, d] fp32."""
    x = F.normalize(x.float(), dim=-1)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    cent = kmeans_pp_seeds(x, n_clusters, gen)
    for _ in range(iters):
        check_cancel()  # a build's cancellation, time bound or turn, between iterations
        cent = lloyd_step(x, cent, cosine=True)
    return cent


def build_tables_gpu(params: CSAttentionParams, q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """CSAttention tables from q [Hq, N, D], k [Hkv, N, D] on their device (contiguous layout):
    dense_score [Hkv, m, C, N] fp16 for full lists (list_fraction 1), else Top-L lists."""
    return build_tables_gpu_layers(params, [q], [k])[0]


def build_tables_gpu_layers(params: CSAttentionParams, qs: list[torch.Tensor], ks: list[torch.Tensor],
                            rows: bool = True) -> list[dict[str, torch.Tensor]]:
    """Tables of several layers (q [Hq, N, D], k [Hkv, N, D] each) with one batched k-means:
    the C - 1 sequential seed draws are launch-bound, so clustering L layers together costs
    about what one layer costs. rows=False: the dense layout's centroids alone (what an
    artifact stores; the rows are derived at load), not rows computed to be dropped."""
    if params.layout != "contiguous":
        raise ValueError(f"layout={params.layout!r}: the GPU build supports 'contiguous' only")
    if len(qs) != len(ks) or not qs:
        raise ValueError(f"need as many query as key tensors (got {len(qs)} and {len(ks)}), at least one")
    hkv, m = ks[0].shape[0], params.subspaces
    subs = [_cluster_input(params, q, hkv) for q in qs]  # [Hkv*m, Nq, d_b] each
    if len({s.shape for s in subs}) > 1:
        raise ValueError(f"layers disagree in shape: {sorted({tuple(s.shape) for s in subs})}")
    cent = kmeans_gpu(torch.cat(subs), params.centroids, params.kmeans_iters, params.seed)
    cent = cent.view(len(qs), hkv, m, params.centroids, -1)
    return [_tables(params, c, k, rows) for c, k in zip(cent, ks)]


def _cluster_input(params: CSAttentionParams, q: torch.Tensor, hkv: int) -> torch.Tensor:
    """The queries a layer clusters (group sums or every head's, sampled) -> [Hkv*m, Nq, d_b]."""
    gq = q.unflatten(0, (hkv, -1))  # [Hkv, G, N, D]
    gq = gq.float().sum(1) if params.routing == "group" else gq.flatten(1, 2)  # [Hkv, N or G*N, D]
    if params.max_queries is not None and gq.shape[1] > params.max_queries:
        gen = torch.Generator(device=q.device).manual_seed(params.seed)
        gq = gq[:, torch.randperm(gq.shape[1], device=q.device, generator=gen)[:params.max_queries]]
    return gq.unflatten(-1, (params.subspaces, -1)).permute(0, 2, 1, 3).flatten(0, 1)


def _tables(params: CSAttentionParams, cent: torch.Tensor, k: torch.Tensor, rows: bool = True) -> dict[str, torch.Tensor]:
    """Tables of one layer from its centroids [Hkv, m, C, d_b] and keys [Hkv, N, D]."""
    n = k.shape[1]
    sub_k = k.unflatten(-1, (params.subspaces, -1)).permute(0, 2, 1, 3)  # [Hkv, m, N, d_b]
    if params.list_length(n) == n and not rows:
        return {"centroids": cent.half()}
    if params.list_length(n) == n:  # the dense layout: fp16 products (fp32 accumulate) straight out
        tables = {"centroids": cent.half(), "dense_score": torch.matmul(cent.half(), sub_k.half().transpose(2, 3))}
        return int8_dense_tables(tables, quantize_rows_fused) if params.int8_tables else tables
    scores = torch.einsum("hmcd,hmnd->hmcn", cent, sub_k.float())
    top = torch.topk(scores, params.list_length(n), dim=-1)
    absent_mean = (scores.sum(-1) - top.values.sum(-1)) / max(n - top.values.shape[-1], 1)
    return {"list_absent_mean": absent_mean.half(), "centroids": cent.half(), "list_idx": top.indices.int(),
            "list_score": top.values.half(), "list_floor": top.values[..., -1].half().contiguous()}
