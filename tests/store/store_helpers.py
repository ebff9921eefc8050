"""Small random artifacts for store tests (seconds, not minutes)."""

from __future__ import annotations

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact


def make_artifact(seed: int = 0, n: int = 64, layers: int = 2, hkv: int = 2, d: int = 16,
                  lists: int = 8, kv_dtype: torch.dtype = torch.float16) -> ContextArtifact:
    """A CSAttention-shaped artifact with random contents (deterministic in seed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        scores = torch.randn(hkv, 2, 4, lists, generator=g).sort(-1, descending=True).values
        tables = {
            "centroids": torch.randn(hkv, 2, 4, d // 2, generator=g).half(),
            "list_idx": torch.stack([torch.randperm(n, generator=g)[:lists]
                                     for _ in range(hkv * 8)]).view(hkv, 2, 4, lists).int(),
            "list_score": scores.half(),
            "list_floor": scores[..., -1].half(),
        }
        out.append(LayerArtifact(k=torch.randn(hkv, n, d, generator=g).to(kv_dtype),
                                 v=torch.randn(hkv, n, d, generator=g).to(kv_dtype), tables=tables))
    return ContextArtifact(
        model_id="random:tiny", model_args={"n_layers": layers, "dim": hkv * d},
        method="csattention", method_params={"subspaces": 2, "centroids": 4},
        tokens=torch.randint(0, 49152, (n,), generator=g), last_logits=torch.randn(100, generator=g),
        layers=out, kv_dtype=str(kv_dtype).removeprefix("torch."))


def assert_same(a: ContextArtifact, b: ContextArtifact) -> None:
    """Bit-exact equality of every tensor (dtype, shape, bits) and every field."""
    def same(x: torch.Tensor, y: torch.Tensor) -> None:
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point and x.dim() else x,
                           y.view(torch.uint8) if y.dtype.is_floating_point and y.dim() else y)

    for f in ("model_id", "model_args", "method", "method_params", "kv_dtype", "format_version"):
        assert getattr(a, f) == getattr(b, f), f
    same(a.tokens, b.tokens)
    same(a.last_logits, b.last_logits)
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        same(la.k, lb.k)
        same(la.v, lb.v)
        assert sorted(la.tables) == sorted(lb.tables)
        assert (la.queries is None) == (lb.queries is None)
        if la.queries is not None:
            same(la.queries, lb.queries)
        for name in la.tables:
            same(la.tables[name], lb.tables[name])


def crash_pool() -> list[ContextArtifact]:
    """The artifacts the crash writer cycles through (small, of different sizes)."""
    return [make_artifact(100 + j, n=n, layers=4, d=32, lists=16)
            for j, n in enumerate((32, 128, 512, 1024))]
