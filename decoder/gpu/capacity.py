"""How many GPU slots an HBM budget holds: the bytes one slot of the fast runner keeps resident.

A slot holds one context for decoding: its K/V in the model's dtype for `max_len` tokens and,
sparse, CSAttention's int8 dense rows (m x C per key and KV head, the rows padded to 16 keys),
their per-row scales, the fp16 centroids, the fp32 overlay of `max_new` streamed keys and
follow's previous best keys and reselect's last selection (GpuDenseTables.empty allocates exactly these). The budget is HBM for resident contexts only:
the weights and the step's working buffers (selector, re-rank, graphs) are outside it, so two
modes given the same budget hold their contexts in the same bytes.
"""

from __future__ import annotations

import torch

from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.config import ModelArgs

MAX_NEW = 512  # the fast runner's default index overlay: keys streamed per slot after its context


def free_bytes(device: torch.device | str | None = None) -> int:
    """The device's free memory as this process can use it: the driver's free bytes plus what
    torch's caching allocator holds unused (a prefill's freed activations stay reserved)."""
    return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))


def slot_bytes(args: ModelArgs, params: CSAttentionParams | None, max_len: int, max_new: int,
               dtype_bytes: int, k_max: int = 0) -> int:
    """Resident bytes of one slot (params None: dense mode, the K/V alone). k_max: the budget's K
    at max_len, reselect's last selection per KV head (0: max_len, an upper bound)."""
    kv = 2 * args.n_layers * args.n_kv_heads * max_len * args.head_dim * dtype_bytes
    if params is None:
        return kv
    m, c = params.subspaces, params.centroids
    per_head = m * c * (-(-max_len // 16) * 16  # int8 rows
                        + 4  # fp32 scale per row
                        + 4 * max(max_new, 1)  # fp32 overlay of streamed keys
                        + 2 * (args.head_dim // m))  # fp16 centroids
    per_head += 4 * params.follows  # int32 previous best keys
    resel = params.reselects > 1
    per_head += 4 * (k_max or max_len) if resel else 0  # int32 last selection
    return kv + args.n_layers * (args.n_kv_heads * per_head + (4 if resel else 0))  # (and a countdown)


def slots_within(budget_bytes: int, args: ModelArgs, params: CSAttentionParams | None, max_len: int,
                 max_new: int, dtype_bytes: int) -> int:
    """Slots whose resident bytes fit the budget; ValueError naming both sizes when none does."""
    each = slot_bytes(args, params, max_len, max_new, dtype_bytes)
    if budget_bytes < each:
        raise ValueError(f"gpu_memory={budget_bytes / 2**30:.2f} GiB holds no slot of {max_len} tokens "
                         f"({each / 2**30:.2f} GiB each in {'dense' if params is None else 'sparse'} mode)")
    return budget_bytes // each


def offload_row_bytes(args: ModelArgs, params: CSAttentionParams, max_len: int, max_new: int, dtype_bytes: int,
                      cached: int, k_hbm: bool = True, v_int8: bool = True) -> int:
    """HBM bytes one offloaded context keeps on the GPU (OffloadRunner's host slot `max_len` tokens
    long): its index rows as a resident slot's, its K buffer (k_hbm), with V as int8 codes their
    fp16 scales and the HBM tail of the positions after the context (max_new + 1), and each
    layer's slot cache of `cached` rows (V, K too without k_hbm; int32 tags, stamps, free list and
    position map, a stamp and ring pointer a head)."""
    layer_heads = args.n_layers * args.n_kv_heads
    row = args.head_dim * dtype_bytes
    rows = slot_bytes(args, params, max_len, max_new, dtype_bytes) - slot_bytes(args, None, max_len, max_new, dtype_bytes)
    k = layer_heads * max_len * row if k_hbm else 0
    tail = layer_heads * ((max_new + 1) * row + 2 * max_len) if v_int8 else 0
    cache = layer_heads * (cached * (row * (1 if k_hbm else 2) + 3 * 4) + (max_len + 1) * 4 + 2 * 4)
    return rows + k + tail + cache
