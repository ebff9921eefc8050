"""CSAttention's GPU table build (batched k-means, tables on the device) against the torch
references of ctxcache.methods; on CPU tensors without a GPU."""

import pytest
import torch
import torch.nn.functional as F

from ctxcache.methods.csattention_build import build_tables_gpu, kmeans_gpu
from ctxcache.methods.kmeans import lloyd_step
from ctxcache.methods.csattention import CSAttention, CSAttentionParams


def test_lloyd_step_matches_reference_update(device):
    x = F.normalize(torch.randn(3, 200, 8), dim=-1)
    cent = F.normalize(torch.randn(3, 7, 8), dim=-1)
    assign = (x @ cent.transpose(1, 2)).argmax(-1)
    want = torch.stack([torch.stack([F.normalize(x[b, assign[b] == c].sum(0), dim=0) if (assign[b] == c).any()
                                     else cent[b, c] for c in range(7)]) for b in range(3)])
    got = lloyd_step(x.to(device), cent.to(device), cosine=True).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kmeans_finds_separated_clusters(device):
    # fixed data: k-means++ may seed two centroids in one cluster on some draws, which Lloyd
    # steps cannot undo (seen once on an H100 with unseeded data)
    gen = torch.Generator().manual_seed(0)
    centers = F.normalize(torch.randn(2, 4, 16, generator=gen), dim=-1)
    x = (centers[:, torch.arange(400) % 4] + 0.05 * torch.randn(2, 400, 16, generator=gen)).to(device)
    cent = kmeans_gpu(x, 4, iters=5).cpu()
    assert ((cent @ centers.transpose(1, 2)).max(1).values > 0.99).all()


def test_build_lists_are_top_scores(device):
    p = CSAttentionParams(subspaces=4, centroids=8, kmeans_iters=2, list_fraction=0.25)
    q, k = torch.randn(4, 300, 32), torch.randn(2, 300, 32)
    t = {n: v.cpu() for n, v in build_tables_gpu(p, q.to(device), k.to(device)).items()}
    ref = CSAttention(p).build(q, k, k)
    assert all(t[n].shape == ref[n].shape for n in ("centroids", "list_idx", "list_score", "list_floor"))
    sub_k = CSAttention(p)._split(k).permute(0, 2, 1, 3)
    scores = torch.einsum("hmcd,hmnd->hmcn", t["centroids"].float(), sub_k)
    top = torch.topk(scores, t["list_idx"].shape[-1], dim=-1).values
    # lists were scored with fp32 centroids, the check uses their fp16 copies: 1e-2 covers the rounding
    torch.testing.assert_close(t["list_score"].float(), top, rtol=1e-2, atol=1e-2)
    assert (t["list_score"][..., 1:] <= t["list_score"][..., :-1]).all()


def test_build_dense_layout_scores_every_key(device):
    """Full lists (the default) in fp16: dense_score rows are every key's fp16 score against
    each centroid, as CSAttention.build stores them; group routing clusters the group sums."""
    for routing in ("head", "group"):
        p = CSAttentionParams(subspaces=4, centroids=8, kmeans_iters=2, routing=routing, table_dtype="float16")
        q, k = torch.randn(4, 300, 32), torch.randn(2, 300, 32)
        t = {n: v.cpu() for n, v in build_tables_gpu(p, q.to(device), k.to(device)).items()}
        ref = CSAttention(p).build(q, k, k)
        assert set(t) == set(ref) == {"centroids", "dense_score"}
        assert t["dense_score"].shape == ref["dense_score"].shape and t["dense_score"].dtype == torch.float16
        sub_k = CSAttention(p)._split(k).permute(0, 2, 1, 3)
        want = torch.einsum("hmcd,hmnd->hmcn", t["centroids"].float(), sub_k)
        torch.testing.assert_close(t["dense_score"].float(), want, rtol=1e-2, atol=1e-2)


def test_build_int8_tables_quantize_the_dense_rows(device):
    """table_dtype="int8": the same keys as CSAttention.build's int8 tables (int8 rows + a
    per-row scale), within the quantization step of the fp16 scores."""
    p = CSAttentionParams(subspaces=4, centroids=8, kmeans_iters=2, table_dtype="int8")
    q, k = torch.randn(4, 300, 32), torch.randn(2, 300, 32)
    t = {n: v.cpu() for n, v in build_tables_gpu(p, q.to(device), k.to(device)).items()}
    assert set(t) == set(CSAttention(p).build(q, k, k)) == {"centroids", "dense_score", "dense_scale"}
    assert t["dense_score"].dtype == torch.int8 and t["dense_scale"].shape == t["dense_score"].shape[:3]
    sub_k = CSAttention(p)._split(k).permute(0, 2, 1, 3)
    want = torch.einsum("hmcd,hmnd->hmcn", t["centroids"].float(), sub_k)
    got = t["dense_score"].float() * t["dense_scale"][..., None]
    assert ((got - want).abs() <= t["dense_scale"][..., None] * 0.5 + 2e-2).all()


def test_group_routing_clusters_the_group_sums(device):
    """Queries whose group sum points one of two ways give centroids near those two ways."""
    p = CSAttentionParams(subspaces=1, centroids=2, kmeans_iters=5, routing="group")
    dirs = F.normalize(torch.randn(2, 16), dim=-1)
    n = 200
    pick = torch.arange(n) % 2
    noise = torch.randn(2, n, 16)  # two query heads whose noise cancels in the sum
    q = torch.stack([dirs[pick] + noise[0], dirs[pick] - noise[0]])  # [Hq=2, N, D], Hkv=1
    cent = build_tables_gpu(p, q.to(device), torch.randn(1, n, 16).to(device))["centroids"].float().cpu()
    assert ((cent[0, 0] @ dirs.T).max(1).values > 0.99).all()


def test_layers_built_together_match_one_by_one_shapes_and_scores(device):
    """One batched k-means over several layers gives each layer tables of the single-layer
    kind: dense rows = its own keys scored against its own centroids."""
    from ctxcache.methods.csattention_build import build_tables_gpu_layers

    p = CSAttentionParams(subspaces=4, centroids=8, kmeans_iters=2, table_dtype="float16")
    qs = [torch.randn(4, 300, 32).to(device) for _ in range(3)]
    ks = [torch.randn(2, 300, 32).to(device) for _ in range(3)]
    out = build_tables_gpu_layers(p, qs, ks)
    assert len(out) == 3
    for t, k in zip(out, ks):
        sub_k = CSAttention(p)._split(k.cpu()).permute(0, 2, 1, 3)
        want = torch.einsum("hmcd,hmnd->hmcn", t["centroids"].float().cpu(), sub_k)
        torch.testing.assert_close(t["dense_score"].float().cpu(), want, rtol=1e-2, atol=1e-2)
    assert not torch.equal(out[0]["centroids"], out[1]["centroids"])  # each layer its own clusters


@pytest.mark.gpu(reason="the indexer's GPU build path needs a GPU")
def test_indexer_builds_csattention_tables_on_the_gpu():
    from ctxcache.indexer.build import IndexerConfig, build_artifact
    from ctxcache.models.loader import load_model

    lm = load_model("random:tiny", seed=3)
    lm.model.to("cuda")
    tokens = torch.randint(0, lm.args.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    art = build_artifact(lm, tokens, CSAttention(), IndexerConfig(kv_dtype="float32", progress=False))
    hkv = lm.args.n_kv_heads
    for layer in art.layers:
        assert "dense_score" not in layer.tables  # format 2 stores the centroids; rows derive at load
        t = CSAttention().restore(layer.tables, layer.k)
        ds = t["dense_score"]
        assert layer.tables["centroids"].device.type == "cpu" and ds.shape[0] == hkv and ds.shape[-1] == 300
        sub_k = CSAttention()._split(layer.k.float()).permute(0, 2, 1, 3)
        want = torch.einsum("hmcd,hmnd->hmcn", t["centroids"].float(), sub_k)
        assert ds.dtype == torch.int8  # the default table_dtype for the dense layout
        step = t["dense_scale"][..., None]
        assert ((ds.float() * step - want).abs() <= step / 2 + 2e-2).all()


def test_build_layers_on_cpu_keys_is_the_cpu_build():
    """Keys on the CPU: build_layers is build_layer layer by layer (the GPU build only where the
    keys are on CUDA); tables come back in layer order."""
    m = CSAttention(CSAttentionParams(subspaces=4, centroids=8, kmeans_iters=2))
    layers = [(torch.randn(4, 120, 32), torch.randn(2, 120, 32), torch.randn(2, 120, 32)) for _ in range(3)]
    got = list(m.build_layers(iter(layers), 3))
    assert len(got) == 3
    for (q, k, v), tables in zip(layers, got):
        want = m.build_layer(q, k, v, 0, 3)
        assert tables.keys() == want.keys()
        for name in want:
            assert torch.equal(tables[name], want[name]), name
