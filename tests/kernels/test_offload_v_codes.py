"""V held as int8 codes in a host slot (kernels/v_codes.py, offload_attention's `coded`): the
kernel against its torch reference, and bit for bit against the bf16-host kernel reading the
decoded V (the old layout is the oracle); the fused RoPE + write into a tail at pos - v_start."""

import pytest
import torch

from ctxcache.host_copy import pinned_exact
from ctxcache.kernels.offload_attention import offload_attention, offload_attention_ref
from ctxcache.kernels.rope_write import rope_write, rope_write_ref
from ctxcache.kernels.v_codes import CodedV, decode_v_into, decode_v_ref, full_v_ref, kind_of
from ctxcache.kv_codec import CodedKV
from ctxcache.models.config import NAMED_CONFIGS
from ctxcache.models.rope import rope_table

B, HQ, HKV, S, D, KMAX, CAP, TAIL = 2, 4, 2, 96, 32, 12, 16, 24
N_CTX = [60, 40]  # each row's context length: positions from it are in the tail
N = [76, 62]  # keys after the step: the recent window and some selected keys reach the tail


def _coded(device, dtype, kinds):
    codes = pinned_exact((B, HKV, S, D), torch.int8)
    codes.copy_(torch.randint(-127, 128, (B, HKV, S, D), dtype=torch.int8))
    scales = pinned_exact((B, HKV, S), torch.float16)
    scales.copy_(torch.rand(B, HKV, S) * 0.02 + 1e-3)
    tail = torch.randn(B, HKV, TAIL, D, dtype=dtype, device=device)
    coded = CodedV(scales, tail, torch.tensor(N_CTX, dtype=torch.int32, device=device),
                   torch.tensor(kinds, dtype=torch.int32, device=device))
    return codes, coded


def _case(device, dtype):
    q = torch.randn(B, HQ, D, dtype=dtype, device=device)
    kh = torch.randn(B, HKV, S, D, dtype=dtype, device=device)  # K in HBM
    idx = torch.stack([torch.stack([torch.randperm(N[i] - 8 - 2)[:KMAX] + 2 for _ in range(HKV)])
                       for i in range(B)]).int()
    slot = torch.empty(B, HKV, KMAX, dtype=torch.int32)
    for i in range(B):
        for h in range(HKV):
            perm = torch.randperm(CAP)
            slot[i, h, :4] = perm[:4].int()  # 4 hits, the rest misses into other slots
            slot[i, h, 4:] = -perm[4:KMAX].int() - 1
    vc = torch.randn(B, HKV, CAP, D, dtype=dtype, device=device)
    return q, kh, idx.to(device), slot.to(device), vc


@pytest.mark.parametrize("dtype,kinds", [(torch.float32, [0, 1]), (torch.bfloat16, [1, 2])])
def test_coded_v_matches_the_reference_and_the_bf16_host_kernel_bit_for_bit(device, dtype, kinds):
    codes, coded = _coded(device, dtype, kinds)
    q, kh, idx, slot, vc = _case(device, dtype)
    k_sel = torch.tensor([KMAX, KMAX - 3], dtype=torch.int32, device=device)
    n = torch.tensor(N, dtype=torch.int32, device=device)
    vc_ref, vc_old = vc.clone(), vc.clone()
    out = offload_attention(q, kh, codes, None, vc, idx, slot, k_sel, n, 2, 8, splits=2, block_n=16, coded=coded)
    ref = offload_attention_ref(q.double(), kh.double(), codes, None, vc_ref, idx.cpu(), slot.cpu(), k_sel.cpu(),
                                n.cpu(), 2, 8, coded=coded)
    assert (out.double().cpu() - ref.cpu()).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(vc, vc_ref)  # misses landed decoded in their slots
    # the oracle: the old kernel over a host V holding the decoded codes and the tail's positions
    full = full_v_ref(codes, coded, dtype).to(device)
    old = offload_attention(q, kh, full, None, vc_old, idx, slot, k_sel, n, 2, 8, splits=2, block_n=16)
    assert torch.equal(out, old) and torch.equal(vc, vc_old)


def test_a_dense_read_every_position_a_static_row(device):
    """sinks >= n, no selected keys (offload_v.CodedDense): every position, codes then the tail."""
    codes, coded = _coded(device, torch.float32, [0, 0])
    q, kh, _, _, vc = _case(device, torch.float32)
    none = torch.zeros(B, HKV, 1, dtype=torch.int32, device=device)
    zero = torch.zeros(B, dtype=torch.int32, device=device)
    n = torch.tensor(N, dtype=torch.int32, device=device)
    out = offload_attention(q, kh, codes, None, vc, none, none, zero, n, S, 0, splits=2, block_n=16, coded=coded)
    full = full_v_ref(codes, coded, torch.float32).to(device)
    ref = offload_attention_ref(q.double(), kh.double(), full.double(), None, vc.clone().double(), none.cpu(),
                                none.cpu(), zero.cpu(), n.cpu(), S, 0)
    assert (out.double().cpu() - ref.cpu()).abs().max() < 1e-5


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_decode_is_the_codecs_arithmetic(device, kind):
    """decode_v_into (dequant_into on a GPU) and decode_v_ref give kv_codec's decoded V exactly."""
    dtype = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}[kind]
    k, v = torch.randn(HKV, 50, D).to(dtype), torch.randn(HKV, 50, D).to(dtype)
    coded = CodedKV.encode(k, v, "int8")
    want = coded.decode()[1].to(torch.bfloat16)
    out = torch.empty(HKV, 50, D, dtype=torch.bfloat16, device=device)
    decode_v_into(coded.parts["v"].to(device), coded.parts["v_scale"].to(device), out, kind_of(dtype))
    assert torch.equal(out.cpu(), want)
    assert torch.equal(decode_v_ref(coded.parts["v"], coded.parts["v_scale"], kind, torch.bfloat16), want)


def test_rope_write_puts_v_into_the_tail_at_pos_minus_start(device):
    b, hq, hkv, d = 3, 4, 2, 32
    q, k, v = (torch.randn(b, h, d, device=device) for h in (hq, hkv, hkv))
    args = NAMED_CONFIGS["llama-3.1-8b"]
    table = rope_table(args.__class__(**{**args.__dict__, "max_seq_len": 128, "head_dim": d}), device)
    pos = torch.tensor([70, 45, 100], device=device)
    start = torch.tensor([60, 40, 10], dtype=torch.int32, device=device)  # row 2: 90, past the tail: not written
    kc = torch.zeros(b, hkv, 128, d, device=device)
    tail = torch.zeros(b, hkv, 16, d, device=device)
    kc_ref, tail_ref = kc.clone(), tail.clone()
    out = rope_write(q, k, v, table, pos, kc, tail, v_start=start)
    ref = rope_write_ref(q, k, v, table, pos, kc_ref, tail_ref, v_start=start)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(kc, kc_ref)
    assert torch.equal(tail, tail_ref)
    assert torch.equal(tail[0, :, 10], v[0]) and torch.equal(tail[1, :, 5], v[1]) and not tail[2].any()
