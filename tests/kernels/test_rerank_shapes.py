"""The re-rank compiles and runs at every GQA group size the named configs have, with candidate
counts that Triton sees divisible by 16 and not (a 127,424-token slot's 25,488 candidates made
LLVM abort the whole process in the score kernel). Each shape runs in a child process, so an
abort fails its case instead of the test run."""

import subprocess
import sys

import pytest
import torch

from ctxcache.models.config import NAMED_CONFIGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHILD = """
import sys, torch
from ctxcache.kernels.rerank import Reranker, rerank_ref
group, kc_max, dtype, key16 = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4] == "1"
batch, hkv, d, n = 2, 2, 128, 4 * int(sys.argv[2]) + 64
k_max = kc_max // 4
r = Reranker(batch, hkv, group, kc_max, k_max, "cuda", key16=key16)
q = torch.randn(batch, hkv * group, d, device="cuda", dtype=dtype)
keys = torch.randn(batch, hkv, n, d, device="cuda", dtype=dtype)
nn = torch.full((batch,), n, dtype=torch.int32, device="cuda")
lo, hi = torch.full_like(nn, 4), nn - 32
kc, k = torch.full_like(nn, kc_max), torch.full_like(nn, k_max)
cand = torch.stack([torch.randperm(n - 36, device="cuda")[:kc_max] + 4 for _ in range(batch * hkv)]).view(batch, hkv, -1).int()
got = r(q, keys, cand, kc, k, lo, hi, nn, 4, 32)
want = rerank_ref(q, keys, cand, kc, lo, hi, nn, k_max, 4, 32)
same = [len(set(g.tolist()) & set(w.tolist())) / k_max for g, w in zip(got.view(-1, k_max), want.view(-1, k_max))]
print("overlap", min(same))
assert min(same) > 0.97, same
"""

GROUPS = sorted({a.n_heads // a.n_kv_heads for a in NAMED_CONFIGS.values()})


@pytest.mark.parametrize("kc_max", [25488, 6760], ids=["kc%16=0", "kc%16=8"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype, key16", [("bfloat16", "1"), ("float32", "0")], ids=["bf16-key16", "fp32"])
def test_rerank_compiles_at_every_group_size(group, kc_max, dtype, key16):
    run = subprocess.run([sys.executable, "-c", CHILD, str(group), str(kc_max), dtype, key16],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
