"""A few queries appended to a long context, attended with each KV head's keys read once.

SDPA over GQA (enable_gqa) gives every query head its own pass over its KV head's keys: a
question's prefill on a 32K context reads K/V once per query head. Here the group's query heads
and the prompt's tokens are the rows of their KV head (as the split-K decode kernel packs them),
the context's keys are cut into spans that run side by side (flash attention with its
log-sum-exp, one program per span and KV head), and the spans' partial outputs merge by their
log-sum-exps with the last keys' (the context's few left over and the prompt's own, causal), in
one launch on a GPU (kernels/span_merge.py).

slot_prefill's attention takes it where it packs (slot_prefill.PACKED_ATTENTION); `ctxcache
bench prefill` times it against SDPA on a GPU.
"""

from __future__ import annotations

import torch

from ctxcache.kernels import span_attention, span_merge
from ctxcache.kernels.split_k_attention import INTERPRET

# packed rows per KV head (group x prompt tokens) up to which the packed path runs: past it the
# tail's [rows x (leftover + prompt)] scores grow with the prompt, and SDPA's per-head pass
# carries enough queries to be bound by compute anyway
MAX_ROWS = 512
# flash programs the spans aim for (span x KV head x 128-row block): at Llama-3.1-8B's shapes 8
# spans of a 32K or 128K context measured fastest on an H100 (bench prefill: fewer, longer
# spans; each span more is one more partial for span_merge to fold in)
TARGET_PROGRAMS = 64
MIN_SPAN = 256  # keys per span at least: shorter spans cost more in partials than they save
# the spans by kernels/span_attention.py instead of flash attention: off until `bench prefill`
# measures it faster on the card (its spankernel rows, beside the flash path's packed rows)
SPAN_KERNEL = False


def packs(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the packed path takes q [B, Hq, T, D] over k [B, Hkv, S, D] (one prompt: B = 1)."""
    g, t = q.shape[1] // k.shape[1], q.shape[2]
    return q.shape[0] == 1 and g * t <= MAX_ROWS and k.shape[2] - t >= MIN_SPAN


def spans_for(programs_per_span: int, ctx: int) -> int:
    """How many spans the context's keys are cut into."""
    want = -(-TARGET_PROGRAMS // max(programs_per_span, 1))
    return max(1, min(want, ctx // MIN_SPAN))


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of q [N, H, R, D] over k, v [N, H, L, D] -> (out [N, H, R, D] in
    q's dtype, log-sum-exp of the scaled logits [N, H, R] fp32). Flash on a GPU in 16 bits;
    elsewhere the same in fp32 math (the CPU tests, fp32 models)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
        return out, lse[..., :q.shape[2]].float()
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = logits.logsumexp(-1)
    return torch.matmul((logits - lse[..., None]).exp(), v.float()).to(q.dtype), lse


def packed_appended_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              spans: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] at the last T of the S positions of k, v [B, Hkv, S, D] (in q's dtype):
    what appended_attention computes, each KV head's keys read once. Needs `packs(q, k)`.
    spans: how many the context's keys are cut into (None: spans_for's choice)."""
    _, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    rows = q[0].reshape(hkv, g * t, d)  # query head h is KV head h // g's rows h % g
    spans = spans or spans_for(hkv * -(-g * t // 128), s - t)
    span = (s - t) // spans
    main = spans * span  # the context's keys left after the spans: fewer than the spans

    def cut(x: torch.Tensor) -> torch.Tensor:  # [Hkv, main, D] -> [spans, Hkv, span, D], a view
        return x[:, :main].unflatten(1, (spans, span)).transpose(0, 1)

    if SPAN_KERNEL and (q.is_cuda or INTERPRET):
        outs, lses = span_attention.span_attention(rows, cut(k[0]), cut(v[0]))
    else:
        outs, lses = attend_with_lse(rows[None].expand(spans, hkv, g * t, d), cut(k[0]), cut(v[0]))
    last = (rows, k[0, :, main:], v[0, :, main:], t, outs, lses)
    merged = span_merge.merge(*last) if q.is_cuda else span_merge.merge_ref(*last)
    return merged.view(1, hq, t, d)
