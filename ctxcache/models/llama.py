"""A lean Llama-family transformer (gpt-fast style) whose attention is a pluggable callable.

The model computes projections, RoPE and the KV-cache write; *which keys each query attends
to* is decided by an `AttentionFn`, so dense and sparse decode share every other line.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ctxcache.models.config import ModelArgs
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.rope import apply_rope, rope_table


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache,
                 pos: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, T, D] (post-RoPE, cache already holds this step's K/V) -> [B, Hq, T, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused launch, same math (fp32 inside, one rounding); ~9 launches otherwise
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        d, hd = args.dim, args.head_dim
        self.q_proj = nn.Linear(d, args.n_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(d, args.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(d, args.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, d, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(self, x: torch.Tensor, layer: int, pos: torch.Tensor, cache: KVCache,
                rope: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        b, t, _ = x.shape
        a = self.args
        q = self.q_proj(x).view(b, t, a.n_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if t == 1 and x.is_cuda and cache.fused_decode_write:  # a decode step: RoPE + cache write in one launch
            # imported here: CPU-only use of the model never loads Triton
            from ctxcache.kernels.rope_write import rope_write
            q = rope_write(q[:, :, 0], k[:, :, 0], v[:, :, 0], rope, pos[:, 0], cache.k[layer],
                           cache.v[layer])[:, :, None]
        else:
            q, k = apply_rope(q, rope, pos), apply_rope(k, rope, pos)
            cache.write(layer, k, v, pos)
        out = attn(layer, q, cache, pos)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, layer, pos, cache, rope, attn):
        x = x + self.self_attn(self.input_layernorm(x), layer, pos, cache, rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Parameter names follow Hugging Face (`model.layers.N...`) so checkpoints load as is."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.model.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.model.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("rope", rope_table(args), persistent=False)

    def new_cache(self, batch: int, max_len: int | None = None, uninitialized: bool = False) -> KVCache:
        a, p = self.args, self.lm_head.weight
        return KVCache(a.n_layers, batch, a.n_kv_heads, max_len or a.max_seq_len, a.head_dim,
                       p.dtype, p.device, uninitialized)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                attn: AttentionFn, last_only: bool = False) -> torch.Tensor:
        """tokens, pos [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only)."""
        if int(pos.max()) >= min(cache.max_len, self.args.max_seq_len):
            raise ValueError(f"position {int(pos.max())} exceeds the cache/model length "
                             f"{min(cache.max_len, self.args.max_seq_len)}")
        x = self.model.embed_tokens(tokens)
        for i, block in enumerate(self.model.layers):
            x = block(x, i, pos, cache, self.rope, attn)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()
