"""CSAttention's lean CPU estimate (the default parameters) against its general path, and the
one-call key selection against torch.gather: both must give the same bits."""

from __future__ import annotations

import pytest
import torch

from ctxcache.methods import make_method
from ctxcache.models.attention import select_keys


def _built(params: dict, n: int = 96, hq: int = 6, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(hq, n, d, generator=g), torch.randn(hkv, n, d, generator=g).half(), None
    method = make_method("csattention", {"subspaces": 4, "centroids": 8, "kmeans_iters": 2, **params})
    return method, method.persist(method.build(q, k.float(), v)), k


def _general(method, state, q, n):
    method._lean_applies = lambda tables: False  # instance attribute: this method only
    try:
        return method.estimate(state, q, n)
    finally:
        del method._lean_applies


@pytest.mark.parametrize("on_demand", [True, False])
@pytest.mark.parametrize("weighting", ["qnorm", "unit"])
def test_lean_estimate_is_the_general_estimate_bit_for_bit(on_demand: bool, weighting: str) -> None:
    method, kept, k = _built({"weighting": weighting})
    tables = method.restore(kept, k, on_demand=on_demand)
    assert method._lean_applies(tables)
    lean, general = method.open(tables), method.open(tables)
    g = torch.Generator().manual_seed(1)
    n = k.shape[1]
    for step in range(6):
        if step >= 2:  # decoded keys: the streamed scores join the estimate
            new = torch.randn(2, 1, 16, generator=g)
            method.append(lean, new, n)
            method.append(general, new, n)
            n += 1
        q = torch.randn(6, 16, generator=g) * (step + 1)
        a, b = method.estimate(lean, q, n), _general(method, general, q, n)
        assert a.shape == b.shape == (2, 1, n)
        assert torch.equal(a, b), step


def test_lean_path_leaves_other_parameters_to_the_general_one() -> None:
    for params in ({"routing": "head"}, {"backoff_cos": 0.5}, {"weighting": "qproj"}, {"table_dtype": "float16"}):
        method, kept, k = _built(params)
        assert not method._lean_applies(method.restore(kept, k, on_demand=True)), params


def test_select_keys_copies_what_gather_copies() -> None:
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 3, 50, 8, generator=g)  # [B, Hkv, S_max, D], as a KV cache holds it
    idx = torch.randint(0, 40, (3, 17), generator=g)
    for x in (cache[1, :, :40], cache[0], cache[1, :, :40].transpose(1, 2).contiguous().transpose(1, 2),
              cache[0, :, :40, :4]):  # strided views, a copy, and one whose rows are not contiguous
        want = torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))
        assert torch.equal(select_keys(x, idx), want)
