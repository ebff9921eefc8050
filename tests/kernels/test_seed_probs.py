"""Follow's seed scores by the three-launch kernel equal the torch reference: the group-summed
softmax of the last query over the real keys, 0 for the padding and up to 16 keys; on the CPU
through TRITON_INTERPRET."""

import pytest
import torch

from ctxcache.kernels.seed_probs import BLOCK, seed_probs, seed_probs_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("hq,hkv,n,n_real,dtype", [
    (8, 2, 300, 290, torch.float32), (4, 4, 2 * BLOCK, 2 * BLOCK, torch.float32), (12, 4, 37, 1, torch.float32),
    (8, 2, 3 * BLOCK + 5, 3 * BLOCK - 7, torch.bfloat16)])
def test_seed_probs_equal_the_reference(hq, hkv, n, n_real, dtype):
    g = torch.Generator().manual_seed(n + hq)
    q = (torch.randn(hq, 64, generator=g) * 3).to(DEVICE, dtype)
    keys = torch.randn(hkv, n + 9, 64, generator=g).to(DEVICE, dtype)[:, :n]  # a slot's first n keys
    out = torch.full((hkv, n + -n % 16), 7.0, device=DEVICE)
    got = seed_probs(q, keys, torch.tensor([n_real], dtype=torch.int32, device=DEVICE), out)
    want = seed_probs_ref(q.float(), keys.float(), torch.arange(n, device=DEVICE) >= n_real)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 1e-2)
    assert torch.all(got[:, n_real:] == 0)
    torch.testing.assert_close(got.sum(-1), torch.full((hkv,), float(hq // hkv), device=DEVICE), rtol=1e-4, atol=1e-4)


def test_seed_probs_refuse_a_wrong_output():
    q, keys = torch.randn(4, 16), torch.randn(2, 40, 16)
    with pytest.raises(ValueError, match="must be contiguous fp32"):
        seed_probs(q, keys, torch.tensor([40], dtype=torch.int32), torch.zeros(2, 40))
