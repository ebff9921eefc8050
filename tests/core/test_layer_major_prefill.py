"""LayerMajorPrefill (every chunk of a layer, then the next) against the chunk-major `prefill`:
the same chunks through the same blocks, so K/V, captured queries and logits are bitwise equal,
and each layer's K/V are final when it is yielded."""

import pytest
import torch

from ctxcache.generation import LayerMajorPrefill, prefill
from ctxcache.models.attention import QueryCapture, dense_attention
from ctxcache.models.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny").model


@pytest.mark.parametrize("n, chunk, cached", [(300, 64, 0), (257, 100, 0), (90, 1024, 0), (200, 48, 37)])
def test_layer_major_is_bitwise_the_chunk_major_prefill(tiny, n, chunk, cached):
    _check_bitwise(tiny, n, chunk, cached)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_a_gpu_layer_major_is_bitwise_the_chunk_major_prefill(dtype):
    """The fused rope/K-V write kernel and CUDA SDPA: the same chunks give the same bits."""
    model = load_model("random:tiny", dtype, "cuda").model
    _check_bitwise(model, 900, 256, 0)
    _check_bitwise(model, 300, 128, 100)


def _check_bitwise(tiny, n: int, chunk: int, cached: int) -> None:
    torch.manual_seed(n)
    ids = torch.randint(0, tiny.args.vocab_size, (1, cached + n)).to(tiny.lm_head.weight.device)
    runs = []
    for layer_major in (False, True):
        cache = tiny.new_cache(1, 1024)
        if cached:  # appended after a row that already holds tokens
            prefill(tiny, ids[:, :cached], cache, dense_attention, chunk)
        capture = QueryCapture(tiny.args.n_layers, keep=torch.arange(0, n, 3))
        if layer_major:
            run = LayerMajorPrefill(tiny, ids[:, cached:], cache, capture, chunk)
            assert list(run.layers()) == list(range(tiny.args.n_layers))
            logits = run.logits
        else:
            logits = prefill(tiny, ids[:, cached:], cache, capture, chunk)
        runs.append((logits, cache, capture))
    (la, ca, qa), (lb, cb, qb) = runs
    assert torch.equal(la, lb)
    assert torch.equal(ca.lengths, cb.lengths) and int(cb.lengths) == cached + n
    for layer in range(tiny.args.n_layers):
        assert torch.equal(ca.k[layer], cb.k[layer]) and torch.equal(ca.v[layer], cb.v[layer])
        assert torch.equal(qa.queries(layer), qb.queries(layer))


def test_each_layer_is_final_when_it_is_yielded(tiny):
    ids = torch.randint(0, tiny.args.vocab_size, (1, 150))
    ref = tiny.new_cache(1, 256)
    prefill(tiny, ids, ref, dense_attention, 32)
    cache = tiny.new_cache(1, 256)
    run = LayerMajorPrefill(tiny, ids, cache, dense_attention, 32)
    for layer in run.layers():
        assert torch.equal(cache.k[layer], ref.k[layer]) and torch.equal(cache.v[layer], ref.v[layer])
        later = range(layer + 1, tiny.args.n_layers)
        assert all(not cache.k[i].any() for i in later)  # nothing of a later layer ran yet
        assert run.logits is None


def test_positions_past_the_cache_are_refused(tiny):
    cache = tiny.new_cache(1, 64)
    with pytest.raises(ValueError, match="exceeds the cache"):
        LayerMajorPrefill(tiny, torch.zeros(1, 65, dtype=torch.long), cache, dense_attention, 16)
    with pytest.raises(ValueError, match="chunk=0"):
        LayerMajorPrefill(tiny, torch.zeros(1, 8, dtype=torch.long), cache, dense_attention, 0)
