"""Static KV cache: one preallocated buffer per layer, rows of a batch may differ in length."""

from __future__ import annotations

from collections.abc import Callable

import torch


class KVCache:
    """Keys and values [B, Hkv, S_max, D] per layer plus the filled length of each row."""

    fused_decode_write = True  # one tensor per layer: a decode step may write it in one launch
    fused_prompt_write = True  # and so may a one-row prompt (llama.Attention.rope_and_write)
    # per row [B], the first position v[layer] holds (None: 0); an offloaded row's V past its
    # int8-coded context lives in a tail that starts there (decoder/gpu/offload_v.py)
    v_start: torch.Tensor | None = None

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", uninitialized: bool = False) -> None:
        """uninitialized: skip zero-filling (a memset of the whole cache costs ~0.15 s for 4K
        tokens on CPU); every row must then be filled by `load_row`, which zeroes its tail."""
        shape = (batch, n_kv_heads, max_len, head_dim)
        alloc = torch.empty if uninitialized else torch.zeros
        self.k = [alloc(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store k, v [B, Hkv, T, D] at positions pos [B, T]."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k[layer][rows, :, pos] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, pos] = v.transpose(1, 2).to(self.v[layer].dtype)

    def load_row(self, row: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """Fill one row from per-layer [Hkv, N, D] tensors (an artifact's KV)."""
        def fill(layer: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
            k_out.copy_(ks[layer])
            v_out.copy_(vs[layer])
        self.fill_row(row, ks[0].shape[1], fill)

    def fill_row(self, row: int, n: int, fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """Fill one row's first n positions: fill(layer, k_out, v_out) writes [Hkv, n, D] views of
        the cache (an artifact layer decodes its coded K/V straight into them); zeroes the rest."""
        if n > self.max_len:
            raise ValueError(f"context of {n} tokens exceeds the cache length {self.max_len}")
        for layer in range(len(self.k)):
            fill(layer, self.k[layer][row, :, :n], self.v[layer][row, :, :n])
            # masked positions must hold finite values: softmax weight 0 times NaN is NaN
            self.k[layer][row, :, n:] = 0
            self.v[layer][row, :, n:] = 0
        self.lengths[row] = n

    def row(self, b: int) -> "KVCache":
        """A one-row view sharing storage, for prefilling one request of a batch."""
        return self.rows(b, b + 1)

    def rows(self, start: int, end: int) -> "KVCache":
        """A view of rows [start, end) sharing storage (and lengths) with this cache."""
        view = KVCache.__new__(KVCache)
        view.k = [k[start:end] for k in self.k]
        view.v = [v[start:end] for v in self.v]
        view.lengths = self.lengths[start:end]
        return view
