"""Follow's seed scores in three launches: each key's attention probability from the prompt's last
query, summed over its GQA group, for the radix Top-K.

GpuDenseTables.seed_follow computes them in torch as a chain (seed_probs_ref) (the logits' GEMM, an fp32 copy,
the scale, the padding's mask, softmax, the group sum, a pad to 16 keys: seven kernels a layer).
Here one launch per (KV head, block of keys) reads the block's keys once for the whole group,
keeps the fp32 logits and writes the block's softmax partial (max, sum of exponentials); one
program per head merges those into its normalizer; a third writes the group-summed
probabilities, zero past the real keys and up to the next multiple of 16.
`ctxcache bench prefill` times it against the chain on a GPU (FUSED_SEED picks).

seed_topk ranks them as 16-bit keys (the probability rounded to fp16, ties to the lowest index):
the third launch writes the keys and radix pass 0's histogram (the second zeroes the Top-K's
workspace), so two radix launches follow instead of the fp32 select's five (H200, a hot sparse
admission at 32K: 128 histogram and 32 collect launches, 1.38 ms of 11.76; admit_profile_resident_h200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.dense_select import store_keys16
from ctxcache.kernels.split_k_attention import INTERPRET, group_queries, padded_group
from ctxcache.kernels.sync import compiled
from ctxcache.kernels.topk import _BINS, _HEAD, blocks16, radix_topk
from ctxcache.methods.budget import fp16_keys

BLOCK = 128  # keys per program
# the probs launch writing 16-bit keys and pass 0 (H200, seed_topk at 32K graph-replayed, us a layer): 256 keys a
# program 41.8, 512 42.4, 1024 49.7 (42.3 with 8 warps), 2048 51.0; pass 0 left to radix_topk's own launch 47.9-57.7
KEY_BLOCK = 256
RADIX_BLOCK = 4096  # keys per radix program (topk.radix_topk's default)
# follow's seed probabilities by the three launches here, else by the torch chain (seed_topk).
# One H100 run of bench prefill (with the radix Top-K): 99 / 197 us a layer at 32K / 128K, the
# chain 112 / 236 (the same follow set: overlap 0.99)
FUSED_SEED = True


def seed_probs_ref(q: torch.Tensor, keys: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, D] over keys [Hkv, n, D] -> fp32 [Hkv, n padded to 16]: the sum over each KV
    head's group of softmax(q . k / sqrt(D)), 0 where padding (bool [P] over the last P keys)
    is set. The torch chain seed_follow runs unless FUSED_SEED."""
    hkv, n, d = keys.shape
    # the logits in the keys' dtype (a bf16 GEMM accumulates in fp32): group_probabilities
    # copies the keys to fp32 first, 134 MB a layer at 32K and Llama-3.1-8B's shapes
    logits = torch.matmul(q.view(hkv, -1, d).to(keys.dtype), keys.transpose(1, 2)).float() * d ** -0.5
    if padding is not None:
        logits[..., n - padding.shape[0]:].masked_fill_(padding, float("-inf"))
    return torch.nn.functional.pad(logits.softmax(-1).sum(1), (0, -n % 16))


# lengths vary with every context: unspecialized, so warm-up's compile serves them all
@triton.jit(do_not_specialize=["n", "n_blocks"])
def _logits_kernel(q_ptr, k_ptr, n_ptr, logit_ptr, part_ptr, n, G, sk_h, sk_n, n_blocks, scale,
                   G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    h, blk = tl.program_id(0), tl.program_id(1)
    q = group_queries(q_ptr, 0, h, G, 0, D, G_PAD, D)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < tl.load(n_ptr)
    k = tl.load(k_ptr + h * sk_h + cols[:, None] * sk_n + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q.to(k.dtype), tl.trans(k))
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    g = tl.arange(0, G_PAD)
    row = h * G_PAD + g
    tl.store(logit_ptr + row[:, None] * n + cols[None, :], s, mask=(g < G)[:, None] & (cols < n)[None, :])
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
    tl.store(part_ptr + (row * n_blocks + blk) * 2, m)
    tl.store(part_ptr + (row * n_blocks + blk) * 2 + 1, total)


@triton.jit(do_not_specialize=["n_blocks", "zero_cols"])
def _norm_kernel(part_ptr, norm_ptr, ws_ptr, G, n_blocks, zero_cols, sws_r, G_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """One program per KV head merges its blocks' partials online into each row's (max, sum):
    once, not in every probs program (that was quadratic in the context: 1.3 ms at 128K). It
    zeroes the head's first zero_cols of the Top-K workspace (the probs launch adds pass 0 there)."""
    h = tl.program_id(0)
    for z in range(0, zero_cols, 1024):
        cols = z + tl.arange(0, 1024)
        tl.store(ws_ptr + h * sws_r + cols, tl.zeros((1024,), tl.int32), mask=cols < zero_cols)
    g = tl.arange(0, G_PAD)
    row = h * G_PAD + g
    top = tl.full((G_PAD,), float("-inf"), tl.float32)
    norm = tl.zeros((G_PAD,), tl.float32)
    for start in range(0, n_blocks, CHUNK):
        b = start + tl.arange(0, CHUNK)
        live = (g < G)[:, None] & (b < n_blocks)[None, :]
        at = (row[:, None] * n_blocks + b[None, :]) * 2
        m = tl.load(part_ptr + at, mask=live, other=float("-inf"))
        total = tl.load(part_ptr + at + 1, mask=live, other=0.0)
        new_top = tl.maximum(top, tl.max(m, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        norm = norm * tl.exp(top - safe) + tl.sum(total * tl.exp(m - safe[:, None]), axis=1)
        top = new_top
    tl.store(norm_ptr + row * 2, tl.where(top == float("-inf"), 0.0, top))
    tl.store(norm_ptr + row * 2 + 1, tl.where(norm > 0, norm, 1.0))


@triton.jit(do_not_specialize=["n", "n_pad"])
def _probs_kernel(logit_ptr, norm_ptr, n_ptr, out_ptr, bounds_ptr, ws_ptr, n, n_pad, G, so_r, sws_r,
                  G_PAD: tl.constexpr, BLOCK: tl.constexpr, KEY16: tl.constexpr, SMEM: tl.constexpr):
    """The group-summed probabilities of a block of keys: fp32, or (KEY16) their 16-bit keys and
    radix pass 0 over the bounds' region (lo, hi, k)."""
    h, blk = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, G_PAD)
    row = h * G_PAD + g
    top, norm = tl.load(norm_ptr + row * 2), tl.load(norm_ptr + row * 2 + 1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    valid = (cols < tl.load(n_ptr))[None, :] & (g < G)[:, None]
    s = tl.load(logit_ptr + row[:, None] * n + cols[None, :], mask=valid, other=float("-inf"))
    p = tl.sum(tl.where(valid, tl.exp(s - top[:, None]) / norm[:, None], 0.0), axis=0)
    if KEY16:  # (the keys past n_pad are zeros, inside the output's width)
        lo, hi, k = tl.load(bounds_ptr), tl.load(bounds_ptr + 1), tl.load(bounds_ptr + 2)
        store_keys16(p, cols, out_ptr + h * so_r, ws_ptr + h * sws_r, lo, hi, k, True, SMEM)
    else:
        tl.store(out_ptr + h * so_r + cols, p, mask=cols < n_pad)


def seed_workspace(hkv: int, g: int, n: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [Hkv x G_PAD, n], then the blocks' (max, sum) partials and each row's merged
    (max, sum), fp32 (static inside a captured graph)."""
    rows = hkv * padded_group(g)
    return (torch.empty(rows, n, dtype=torch.float32, device=device),
            torch.empty(rows * (triton.cdiv(n, BLOCK) + 1) * 2, dtype=torch.float32, device=device))


def seed_probs(q: torch.Tensor, keys: torch.Tensor, n_real: torch.Tensor, out: torch.Tensor,
               ws: tuple[torch.Tensor, torch.Tensor] | None = None,
               hist: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """seed_probs_ref's result into out (fp32 [Hkv, n padded to 16], contiguous). q [Hq, D];
    keys [Hkv, n, D] (last dim contiguous); n_real int32 [1] on the device (no host sync: a
    prefill graph replays it for any prompt length). hist = (bounds int32 [lo, hi, k], the Top-K
    workspace): out is uint16 [Hkv, >= n rounded up to KEY_BLOCK] and gets the 16-bit keys, the
    workspace pass 0 of a radix select over [lo, hi) (radix_topk's hist0_done)."""
    hkv, n, d = keys.shape
    g = q.shape[0] // hkv
    n_pad = n + -n % 16
    block = KEY_BLOCK if hist is not None else BLOCK
    width = triton.cdiv(n_pad, block) * block if hist is not None else n_pad
    dtype = torch.uint16 if hist is not None else torch.float32
    if out.dim() != 2 or out.shape[0] != hkv or out.shape[1] < width or out.dtype != dtype or out.stride(1) != 1:
        name = "uint16" if hist is not None else "fp32"
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be contiguous {name} [{hkv}, >= {width}]")
    if keys.stride(2) != 1 or n_real.shape != (1,) or n_real.dtype != torch.int32:
        raise ValueError("keys need a contiguous last dim and n_real must be int32 [1]")
    bounds, radix_ws = hist if hist is not None else (n_real, out)
    zero_cols = workspace_columns(n) if hist is not None else 0
    if hist is not None and (radix_ws.shape[0] != hkv or radix_ws.shape[1] < zero_cols or radix_ws.stride(1) != 1):
        raise ValueError(f"workspace {tuple(radix_ws.shape)} must be [{hkv}, >= {zero_cols}] for {n} keys")
    logits, parts = ws if ws is not None else seed_workspace(hkv, g, n, keys.device)
    n_blocks = triton.cdiv(n, BLOCK)
    g_pad = padded_group(g)
    _logits_kernel[(hkv, n_blocks)](q.contiguous(), keys, n_real, logits, parts, n, g, keys.stride(0),
                                    keys.stride(1), n_blocks, d ** -0.5, G_PAD=g_pad, D=d, BLOCK=BLOCK,
                                    IEEE=q.dtype == torch.float32 or INTERPRET)
    norm = parts[-hkv * g_pad * 2:]  # the rows' (max, sum): after the blocks' partials
    _norm_kernel[(hkv,)](parts, norm, radix_ws, g, n_blocks, zero_cols, radix_ws.stride(0), G_PAD=g_pad, CHUNK=128)
    _probs_kernel[(hkv, triton.cdiv(n_pad, block))](logits, norm, n_real, out, bounds, radix_ws, n, n_pad, g,
                                                    out.stride(0), radix_ws.stride(0), G_PAD=g_pad, BLOCK=block,
                                                    KEY16=hist is not None, SMEM=compiled(out))
    return out


def workspace_columns(n: int) -> int:
    """Columns of seed_topk's radix workspace over n keys (rows padded to 16)."""
    return _HEAD + blocks16(n + -n % 16, RADIX_BLOCK) * _BINS


def seed_topk(q: torch.Tensor, keys: torch.Tensor, bounds: torch.Tensor, ws: torch.Tensor, out: torch.Tensor,
              real_keys: torch.Tensor | None = None, padding: torch.Tensor | None = None) -> torch.Tensor:
    """Follow's seed: the k best keys in [lo, hi) (bounds int32 [3] = lo, hi, k, device) of q
    [Hq, D] over keys [Hkv, n, D] by the group-summed softmax over the real keys, ranked as
    16-bit keys, into out [1, Hkv, >= k] int32 (order unspecified). real_keys (int32 [1]) and
    padding (bool [P] over the last P keys) say which keys are real, on the device; None: all n.
    ws: the Top-K workspace, [Hkv, >= its columns for n keys] (topk.workspace with
    blocks16(n, RADIX_BLOCK) blocks)."""
    hkv, n, _ = keys.shape
    if FUSED_SEED:
        real = real_keys if real_keys is not None else torch.full((1,), n, dtype=torch.int32, device=keys.device)
        codes = torch.empty(hkv, triton.cdiv(n + -n % 16, KEY_BLOCK) * KEY_BLOCK, dtype=torch.uint16,
                            device=keys.device)
        seed_probs(q, keys, real, codes, hist=(bounds, ws))
    else:  # the torch chain, ranked by the same 16-bit keys
        codes = fp16_keys(seed_probs_ref(q, keys, padding)).to(torch.uint16)
    n_pad = n + -n % 16
    # the collect compiled for the workspace's blocks, not this row's: a longer context than the
    # warm-up's compiled nothing new while serving (H200, 32K: the collect did, at the first admission)
    nb_pad = triton.next_power_of_2(max(1, (ws.shape[1] - _HEAD) // _BINS))
    return radix_topk(codes[None, :, :n_pad], bounds[0:1], bounds[1:2], bounds[2:3], out, ws, block=RADIX_BLOCK,
                      hist0_done=FUSED_SEED, nb_pad=nb_pad)
