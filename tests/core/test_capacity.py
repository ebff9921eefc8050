"""decoder/gpu/capacity.py: a slot's counted bytes are the bytes the runner allocates for it."""

from __future__ import annotations

import pytest
import torch

from ctxcache.decoder.gpu.capacity import slot_bytes, slots_within
from ctxcache.decoder.gpu.tables import GpuDenseTables
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.config import ModelArgs
from ctxcache.models.kv_cache import KVCache

ARGS = ModelArgs(vocab_size=64, dim=128, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=64, intermediate_size=256)


def _allocated(params: CSAttentionParams | None, max_len: int, max_new: int, dtype: torch.dtype, k_max: int) -> int:
    """What GpuRunner allocates for one slot: the KV cache row and, sparse, a table row per layer."""
    cache = KVCache(ARGS.n_layers, 1, ARGS.n_kv_heads, max_len, ARGS.head_dim, dtype)
    total = sum(t.nbytes for t in cache.k + cache.v)
    if params is not None:
        m, c = params.subspaces, params.centroids
        like = {"centroids": torch.zeros(ARGS.n_kv_heads, m, c, ARGS.head_dim // m, dtype=torch.float16),
                "dense_score": torch.zeros(ARGS.n_kv_heads, m, c, 1, dtype=torch.int8),
                "dense_scale": torch.zeros(ARGS.n_kv_heads, m, c)}
        for _ in range(ARGS.n_layers):
            t = GpuDenseTables.empty(1, like, max_len, max_new, "cpu", params.follows,
                                     k_max if params.reselects > 1 else 0)
            parts = (t.centroids, t.dense_score, t.score_scale, t.new_scores, t.follow_prev, t.chosen_prev,
                     t.reselect_left)
            total += sum(x.nbytes for x in parts if x is not None)
    return total


@pytest.mark.parametrize("params", [None, CSAttentionParams(), CSAttentionParams(subspaces=8, centroids=128),
                                    CSAttentionParams(centroids=32, subspaces=4, follow=0), CSAttentionParams(reselect=2)],
                         ids=["dense", "default", "8x128", "4x32-no-follow", "reselect2"])
@pytest.mark.parametrize("max_len", [1000, 1024])
def test_slot_bytes_are_what_a_slot_allocates(params, max_len):
    dtype = torch.bfloat16
    assert slot_bytes(ARGS, params, max_len, 96, dtype.itemsize, 50) == _allocated(params, max_len, 96, dtype, 50)


def test_a_smaller_index_holds_more_slots_and_a_too_small_budget_is_named():
    large, small = CSAttentionParams(subspaces=8, centroids=128), CSAttentionParams(subspaces=16, centroids=16)
    each_large = slot_bytes(ARGS, large, 4096, 512, 2)
    budget = 10 * each_large
    assert slots_within(budget, ARGS, large, 4096, 512, 2) == 10
    assert slots_within(budget, ARGS, small, 4096, 512, 2) > 10
    assert slots_within(budget, ARGS, None, 4096, 512, 2) > slots_within(budget, ARGS, small, 4096, 512, 2)
    with pytest.raises(ValueError, match="holds no slot of 4096 tokens"):
        slots_within(each_large - 1, ARGS, large, 4096, 512, 2)


@pytest.mark.parametrize("k_hbm,v_int8", [(True, True), (True, False), (False, False)])
def test_offload_row_bytes_are_what_an_offloaded_row_allocates_on_the_gpu(k_hbm, v_int8):
    """An OffloadRunner's host slot keeps on the GPU its index rows (as a resident slot's, tested
    above), its K buffer, the int8 V's scales and tail, and its layers' slot caches: bench serve sizes the
    offloaded contexts a card holds by this count."""
    from ctxcache.decoder.gpu.capacity import offload_row_bytes
    from ctxcache.decoder.gpu.offload import SlotCache
    from ctxcache.decoder.gpu.offload_k import k_buffers
    from ctxcache.decoder.gpu.offload_v import CodedHostKVPool
    params, max_len, max_new, cached, dtype = CSAttentionParams(), 1024, 96, 200, torch.bfloat16
    rows = slot_bytes(ARGS, params, max_len, max_new, 2) - slot_bytes(ARGS, None, max_len, max_new, 2)
    device = torch.device("cpu")
    k = sum(t.nbytes for t in k_buffers(ARGS, 1, max_len, dtype, device)) if k_hbm else 0
    pool = CodedHostKVPool(ARGS.n_layers, 1, ARGS.n_kv_heads, max_len, ARGS.head_dim, dtype, device, max_new + 1)
    tail = sum(t.nbytes for t in pool.v + pool.v_scales) if v_int8 else 0
    _, c = SlotCache.layers(ARGS.n_layers, 1, ARGS.n_kv_heads, cached, max_len, ARGS.head_dim, dtype, device,
                            keys=not k_hbm)
    busy, free, stamp, _ = c.scratch
    caches = sum(t.nbytes for t in (c.k, c.v, c.tag, c.slot_of, busy, free, stamp, c.ring))
    assert offload_row_bytes(ARGS, params, max_len, max_new, 2, cached, k_hbm, v_int8) == rows + k + tail + caches
