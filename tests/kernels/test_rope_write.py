"""The decode step's fused RoPE + KV-cache write against apply_rope + KVCache.write."""

import pytest
import torch

from ctxcache.kernels.rope_write import rope_write, rope_write_prompt, rope_write_ref
from ctxcache.models.config import NAMED_CONFIGS
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.rope import apply_rope, rope_table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_matches_reference(device, dtype):
    b, hq, hkv, d, s = 3, 8, 2, 64, 40
    args = NAMED_CONFIGS["llama-3.1-8b"]  # Llama-3.1 scaled frequencies
    # a model cast to bf16 casts its table too
    table = rope_table(args.__class__(**{**args.__dict__, "max_seq_len": s, "head_dim": d}), device).to(dtype)
    proj = torch.randn(b, (hq + 2 * hkv) * d, device=device).to(dtype)  # q, k, v as views of one output
    q = proj[:, :hq * d].view(b, hq, d)
    k = proj[:, hq * d:(hq + hkv) * d].view(b, hkv, d)
    v = proj[:, (hq + hkv) * d:].view(b, hkv, d)
    pos = torch.tensor([0, 17, 39], device=device)
    caches = [torch.full((b, hkv, s, d), float("nan"), device=device, dtype=dtype) for _ in range(4)]
    got = rope_write(q, k, v, table, pos, caches[0], caches[1])
    want = rope_write_ref(q, k, v, table, pos, caches[2], caches[3])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding here, one per product there
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for got_c, want_c in ((caches[0], caches[2]), (caches[1], caches[3])):
        # written rows equal, every other row left untouched (still NaN)
        torch.testing.assert_close(got_c.float(), want_c.float(), rtol=tol, atol=tol, equal_nan=True)
        assert got_c.isnan().sum() == b * hkv * (s - 1) * d


def test_rope_write_refuses_bad_shapes(device):
    q = torch.randn(2, 4, 12, device=device)  # head_dim 12: half is not a power of two
    k = v = torch.randn(2, 2, 12, device=device)
    cache = torch.zeros(2, 2, 8, 12, device=device)
    with pytest.raises(ValueError, match="power of two"):
        rope_write(q, k, v, torch.zeros(8, 2, 6, device=device), torch.zeros(2, dtype=torch.long, device=device),
                   cache, cache.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_row_prompt_goes_in_as_rows(device, dtype):
    """A prefill's RoPE + write (llama.Attention on the GPU): the prompt's tokens as the launcher's
    rows, all writing the one cache row, equal apply_rope + KVCache.write."""
    hq, hkv, d, s, t = 8, 2, 64, 40, 5
    args = NAMED_CONFIGS["llama-3.1-8b"]
    table = rope_table(args.__class__(**{**args.__dict__, "max_seq_len": s, "head_dim": d}), device).to(dtype)
    proj = torch.randn(1, t, (hq + 2 * hkv) * d, device=device).to(dtype)  # as the model's one qkv_proj
    q, k, v = (x.view(1, t, -1, d).transpose(1, 2) for x in proj.split([hq * d, hkv * d, hkv * d], dim=-1))
    pos = torch.arange(30, 30 + t, device=device)
    got_cache, want_cache = (KVCache(1, 1, hkv, s, d, dtype, torch.device(device)) for _ in range(2))
    for c in (got_cache, want_cache):
        c.k[0].fill_(float("nan"))
    got = rope_write_prompt(q, k, v, table, pos, got_cache.k[0], got_cache.v[0])
    want = apply_rope(q, table, pos[None])
    want_cache.write(0, apply_rope(k, table, pos[None]), v, pos[None])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for got_c, want_c in ((got_cache.k[0], want_cache.k[0]), (got_cache.v[0], want_cache.v[0])):
        torch.testing.assert_close(got_c.float(), want_c.float(), rtol=tol, atol=tol, equal_nan=True)
    assert got_cache.k[0].isnan().sum() == hkv * (s - t) * d  # the other positions untouched
