"""logit_decode_attention: the chosen keys' logits gathered by candidate slot from a re-rank's
workspace, V alone read for them; the sinks and recent window from K. Against its torch
reference (logit_attention_ref) with logits unrelated to K (so a kernel that read K for the
chosen keys would fail), and with the logits K gives against sparse_decode_attention; on CPU
through the Triton interpreter."""

import pytest
import torch

from ctxcache.kernels.logit_attention import chosen_bytes, logit_attention_ref, logit_decode_attention
from ctxcache.kernels.split_k_attention import sparse_decode_attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # relative L2 error (bf16: p and V in bf16 MMAs)


def _case(gen: torch.Generator, dtype: torch.dtype, device, g: int = 4):
    b, hkv, s, d, kc = 3, 2, 300, 32, 90
    q = torch.randn(b, hkv * g, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    n = torch.tensor([300, 150, 20], dtype=torch.int32)
    k_sel = torch.tensor([41, 23, 1], dtype=torch.int32)
    # candidate slots distinct in [0, kc), their positions anywhere in the region, junk past k_sel
    slots = torch.stack([torch.stack([torch.randperm(kc, generator=gen)[:41] for _ in range(hkv)])
                         for _ in range(b)]).int()
    idx = torch.randint(4, 12, (b, hkv, 41), generator=gen, dtype=torch.int32)
    logits = torch.randn(b * hkv, kc, g, generator=gen) * 3
    return [t.to(device) for t in (q, k, v, n, k_sel, idx, slots, logits)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_matches_reference_with_the_given_logits(device, dtype, splits):
    q, k, v, n, k_sel, idx, slots, logits = _case(torch.Generator().manual_seed(0), dtype, device)
    out = torch.full_like(q, float("nan"))
    logit_decode_attention(q, k, v, n, idx, slots, logits, k_sel, sinks=4, recent=16, splits=splits, out=out,
                           block_n=16)
    ref = logit_attention_ref(q.double(), k.double(), v.double(), idx, slots, logits.double(), k_sel, n, 4, 16)
    assert not torch.isnan(out).any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


@pytest.mark.parametrize("g", [4, 3])
def test_with_the_logits_of_k_it_equals_the_split_k_attention(device, g):
    """Logits computed from K as the re-rank does (q.k * d ** -0.5): the same attention as
    reading K, up to fp32 rounding."""
    q, k, v, n, k_sel, idx, slots, _ = _case(torch.Generator().manual_seed(1), torch.float32, device, g)
    b, hkv, d = k.shape[0], k.shape[1], k.shape[3]
    kc = 90
    cand = torch.randint(0, 300, (b, hkv, kc), dtype=torch.int32, device=device)
    for r in range(b):  # the chosen keys are candidates: position idx = cand[slot]
        cand[r] = torch.randint(4, int(n[r]) - 16 if int(n[r]) > 20 else 5, (hkv, kc), device=device)
    idx = torch.gather(cand, 2, slots.long()).int()
    keys = torch.gather(k, 2, cand.long()[..., None].expand(-1, -1, -1, d))  # [B, Hkv, KC, D]
    logits = torch.einsum("bhgd,bhcd->bhcg", q.view(b, hkv, g, d), keys).reshape(b * hkv, kc, g) * d ** -0.5
    got = logit_decode_attention(q, k, v, n, idx, slots, logits.contiguous(), k_sel, 4, 16, splits=4, block_n=16)
    want = sparse_decode_attention(q, k, v, n, idx, k_sel, 4, 16, splits=4, block_n=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_refuses_head_major_logits(device):
    q, k, v, n, k_sel, idx, slots, logits = _case(torch.Generator().manual_seed(2), torch.float32, device)
    with pytest.raises(ValueError, match="keep_logits"):
        logit_decode_attention(q, k, v, n, idx, slots, logits.transpose(1, 2), k_sel, 4, 16)


def test_chosen_bytes_at_llama_shapes():
    """32K x 8: K = 1,639 chosen keys a row, 8 KV heads, G = 4, D = 128, bf16: 53.7 MB of K + V
    against 29.0 MB of V, logits and slots."""
    got = chosen_bytes(8, 8, 1639, 4, 128)
    assert got["k_and_v"] == 8 * 8 * 1639 * 512 and got["v_and_logits"] == 8 * 8 * 1639 * (256 + 20)
