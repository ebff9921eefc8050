"""The re-rank over the int8 codec's keys (CSAttention's rerank_k="int8"): the Triton logits read
int8 codes and their per-group scales and pick what the torch reference (rerank_ref with
key_scales) and the CPU method's reference (exact_rerank over int8_coded_keys) pick, per row of
a batch of different lengths, on a slot length (300) that is no multiple of the 128-token group:
exactly for fp32 inputs; for bf16 keys within 1% of the K-th may swap (16-bit ranking keys)."""

import pytest
import torch

from ctxcache.kernels.rerank import Reranker, rerank_ref
from ctxcache.kv_codec import KEY_GROUP, quantize_keys
from ctxcache.methods.csattention_refs import exact_rerank, int8_coded_keys

from tests.kernels.test_gpu_rerank import _group_probs, _rows


def _slot_codes(keys: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A slot's int8 K: each row's first n keys as the codec stores a cache of n keys, zeros after."""
    b, hkv, length, d = keys.shape
    codes = torch.zeros(b, hkv, length, d, dtype=torch.int8)
    scales = torch.zeros(b, hkv, -(-length // KEY_GROUP), d, dtype=torch.float16)
    for r in range(b):
        q8, s = quantize_keys(keys[r, :, :int(n[r])])
        codes[r, :, :q8.shape[1]], scales[r, :, :s.shape[1]] = q8, s
    return codes, scales


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [4, 3])
def test_int8_key_rerank_equals_the_methods_reference_per_row(device, impl, dtype, group):
    q, keys, cand, n, lo, hi, k, kc, sinks, recent = _rows(torch.Generator().manual_seed(1), dtype, group)
    keys = keys * torch.linspace(0.2, 3.0, keys.shape[-1]).to(dtype)  # channels of different ranges
    keys[:, :, 1] = 100.0  # a sink's outlier: its group's codes are coarse, so int8 changes choices
    codes, scales = _slot_codes(keys, n)
    dev = [t.to(device) for t in (q, codes, scales, cand)] + [t.int().to(device) for t in (kc, k, lo, hi, n)]
    qd, cd8, sd, cnd, kcd, kd, lod, hid, nd = dev
    kc_max, k_max = cand.shape[2] - 5, int(k.max())
    if impl == "torch":
        got = rerank_ref(qd, cd8, cnd, kcd, lod, hid, nd, k_max, sinks, recent, key_scales=sd).cpu()
    else:
        rr = Reranker(q.shape[0], keys.shape[1], group, kc_max, k_max, device, programs=12)
        got = rr(qd, cd8, cnd, kcd, kd, lod, hid, nd, sinks, recent, key_scales=sd).cpu()
    swaps = 0
    for r in range(q.shape[0]):
        nr, kr = int(n[r]), int(k[r])
        coded = int8_coded_keys(keys[r, :, :nr])  # what the CPU method's re-rank scores with
        others = torch.cat([torch.arange(int(lo[r])), torch.arange(int(hi[r]), nr)]).expand(keys.shape[1], -1)
        cr = cand[r, :, :int(kc[r])].long()
        want = exact_rerank(q[r], coded, cr, kr, others)
        plain = exact_rerank(q[r], keys[r, :, :nr], cr, kr, others)
        swaps += sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(want, plain))
        probs = _group_probs(q[r], coded, cr, others)
        for h in range(keys.shape[1]):
            diff = set(got[r, h, :kr].tolist()) ^ set(want[h].tolist())
            if dtype == torch.float32:
                assert not diff, (r, h)
                continue
            by_key = dict(zip(cr[h].tolist(), probs[h].tolist()))
            kth = sorted(probs[h].tolist(), reverse=True)[kr - 1]
            assert all(abs(by_key[x] - kth) <= 0.01 * kth for x in diff), (r, h, diff)
    assert swaps, "the codes change no row's choice here: the test would not tell int8 keys from 16-bit ones"


def test_int8_keys_need_their_scales_in_the_codecs_shape(device):
    rr = Reranker(1, 2, 4, 8, 2, device, programs=2)
    q = torch.zeros(1, 8, 16, device=device)
    cand = torch.zeros(1, 2, 8, dtype=torch.int32, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    codes = torch.zeros(1, 2, 300, 16, dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match="key_scales"):
        rr(q, codes, cand, one, one, one, one, one, 0, 0)
    with pytest.raises(ValueError, match=r"need int8 keys and scales \(1, 2, 3, 16\)"):
        rr(q, codes, cand, one, one, one, one, one, 0, 0, key_scales=torch.zeros(1, 2, 2, 16, device=device))
