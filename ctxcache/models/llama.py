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
        # q, k and v in one weight: one GEMM reads it (H100, Llama-3.1-8B, 8 or 32 rows: 24 vs 36
        # us a layer as three). Checkpoints keep their q/k/v_proj names (the two hooks).
        self.qkv_split = [args.n_heads * hd, args.n_kv_heads * hd, args.n_kv_heads * hd]
        self.qkv_proj = nn.Linear(d, sum(self.qkv_split), bias=args.attention_bias)
        self.register_load_state_dict_pre_hook(_fuse_qkv_keys)
        self.register_state_dict_post_hook(_split_qkv_keys)
        self.o_proj = nn.Linear(args.n_heads * hd, d, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(self, x: torch.Tensor, layer: int, pos: torch.Tensor, cache: KVCache,
                rope: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        b, t, _ = x.shape
        a = self.args
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = q.view(b, t, a.n_heads, a.head_dim).transpose(1, 2)
        k = k.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = v.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope_and_write(q, k, v, layer, pos, cache, rope)
        out = attn(layer, q, cache, pos)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    @staticmethod
    def rope_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pos: torch.Tensor,
                       cache: KVCache, rope: torch.Tensor) -> torch.Tensor:
        """Rotated queries; the rotated keys and the values stored in the cache. On the GPU a
        decode step (one token a row) or a one-row prompt (its tokens taken as rows, each
        writing its own position of the one cache row) in one launch: the torch path is ~25
        launches a layer, each costing more than its work. With the one qkv GEMM, a 20-token
        question's admission on a resident 32K slot (H100, Llama-3.1-8B) takes 9.8 ms dense,
        14.3 sparse, against 11.7 and 15.8 before."""
        b, _, t, _ = q.shape
        fused = cache.fused_decode_write if t == 1 else b == 1 and cache.fused_prompt_write
        if not q.is_cuda or not fused:
            # q and k rotated as one tensor: the same products, each one launch instead of two (an
            # offloaded row's prompt runs this path on the GPU: 11 launches a layer, not 20)
            q, k = apply_rope(torch.cat([q, k], 1), rope, pos).split([q.shape[1], k.shape[1]], 1)
            cache.write(layer, k, v, pos)
            return q
        # imported here: CPU-only use of the model never loads Triton
        from ctxcache.kernels.rope_write import rope_write, rope_write_prompt
        if t == 1:
            return rope_write(q[:, :, 0], k[:, :, 0], v[:, :, 0], rope, pos[:, 0], cache.k[layer],
                              cache.v[layer], v_start=cache.v_start)[:, :, None]
        return rope_write_prompt(q, k, v, rope, pos[0], cache.k[layer], cache.v[layer])


_QKV = ("q_proj", "k_proj", "v_proj")


def _fuse_qkv_keys(module: nn.Module, state: dict, prefix: str, *_) -> None:
    """A checkpoint's q/k/v_proj tensors, loaded as the one qkv_proj."""
    for kind in ("weight", "bias"):
        names = [f"{prefix}{n}.{kind}" for n in _QKV]
        if all(n in state for n in names):
            state[f"{prefix}qkv_proj.{kind}"] = torch.cat([state.pop(n) for n in names])


def _split_qkv_keys(module: nn.Module, state: dict, prefix: str, _meta) -> None:
    """qkv_proj saved under the checkpoint's q/k/v_proj names (views: a saver makes them contiguous)."""
    for kind in ("weight", "bias"):
        fused = state.pop(f"{prefix}qkv_proj.{kind}", None)
        if fused is not None:
            for name, part in zip(_QKV, fused.split(module.qkv_split)):
                state[f"{prefix}{name}.{kind}"] = part


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
