"""GraphDecoder's host-side length bookkeeping (no device sync per step): steps match the model's
own forward, the cache-full check still fires, and lengths changed from outside are re-read."""

import pytest
import torch

from ctxcache.decoder.gpu.attention import GpuDenseAttention
from ctxcache.decoder.gpu.graph import GraphDecoder
from ctxcache.models.attention import dense_attention
from ctxcache.models.loader import load_model


def _decoder(device: str, max_len: int) -> tuple[GraphDecoder, torch.nn.Module]:
    model = load_model("random:tiny", seed=3).model.to(device)
    cache = model.new_cache(2, max_len=max_len)
    # the split-K kernel: graph-capturable on a GPU, interpreted on the CPU
    attn = GpuDenseAttention(2, model.args.n_kv_heads, max_len)
    return GraphDecoder(model, cache, attn), model


def test_steps_match_forward_and_stop_when_full(device):
    dec, model = _decoder(device, max_len=4)
    ref_cache = model.new_cache(2, max_len=4)
    tok = torch.tensor([3, 5], device=device)
    for t in range(4):
        got = dec.step(tok).clone()
        want = model(tok[:, None], torch.full((2, 1), t, device=device), ref_cache, dense_attention)[:, -1].float()
        ref_cache.lengths += 1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert dec.cache.lengths.tolist() == [4, 4]
    with pytest.raises(ValueError, match="cache full"):
        dec.step(tok)


def test_lengths_changed_from_outside_are_reread(device):
    dec, _ = _decoder(device, max_len=4)
    tok = torch.tensor([1, 2], device=device)
    dec.step(tok)
    dec.cache.lengths.fill_(4)  # e.g. a row loaded with a longer context
    dec.lengths_changed()
    with pytest.raises(ValueError, match="cache full"):
        dec.step(tok)
