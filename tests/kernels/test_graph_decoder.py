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
    for t in range(4):
        # a new token each step: over one repeated token every V is equal, so a wrong length
        # (the attention reading too few keys) would give the same output
        tok = torch.tensor([3 + t, 5 + 2 * t], device=device)
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


class _CountingAttention:
    """Dense attention that counts its calls in a tensor it carries from step to step, as
    CSAttention's follow carries its previous best keys."""

    def __init__(self, inner, device: str) -> None:
        self.inner, self.calls = inner, torch.zeros(1, dtype=torch.int32, device=device)

    def carried(self) -> list[torch.Tensor]:
        return [self.calls]

    def __call__(self, layer, q, cache, pos):
        self.calls += 1
        return self.inner(layer, q, cache, pos)


def test_a_capture_leaves_carried_state_as_one_step_would(device):
    """A graph capture runs the step twice to warm up before it records it: a step's carried
    state must advance once per step, not three times on a bucket's first step (on a GPU the
    follow default's first replay followed keys of steps that never happened)."""
    model = load_model("random:tiny", seed=3).model.to(device)
    cache = model.new_cache(2, max_len=4)
    attn = _CountingAttention(GpuDenseAttention(2, model.args.n_kv_heads, 4), device)
    dec = GraphDecoder(model, cache, attn)
    tok = torch.tensor([3, 5], device=device)
    for step in (1, 2):
        dec.step(tok)
        assert int(attn.calls) == step * model.args.n_layers
