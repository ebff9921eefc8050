"""A lean Llama-family transformer (gpt-fast style) whose attention is a pluggable callable.

The model computes projections, RoPE and the KV-cache write; *which keys each query attends
to* is decided by an `AttentionFn`, so dense and sparse decode share every other line.
"""

from __future__ import annotations

from functools import partial
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
        if x.is_cuda:  # one launch, same math (fp32 inside, one rounding); ~9 launches otherwise
            from ctxcache.kernels.norm import rms_norm  # here: CPU-only use never loads Triton
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it): on the GPU one launch instead of two."""
        if x.is_cuda:
            from ctxcache.kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps, delta=delta)
        total = x + delta
        return total, self(total)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        d, hd = args.dim, args.head_dim
        # q, k and v in one weight: one GEMM reads it (H100, Llama-3.1-8B, 8 or 32 rows: 24 vs 36
        # us a layer as three). Checkpoints keep their q/k/v_proj names (the two hooks).
        self.qkv_split = [args.n_heads * hd, args.n_kv_heads * hd, args.n_kv_heads * hd]
        self.qkv_proj = nn.Linear(d, sum(self.qkv_split), bias=args.attention_bias)
        self.register_load_state_dict_pre_hook(partial(_fuse_keys, names=_QKV, fused="qkv_proj"))
        self.register_state_dict_post_hook(partial(_split_keys, names=_QKV, fused="qkv_proj", sizes=self.qkv_split))
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
_GATE_UP = ("gate_proj", "up_proj")


def _fuse_keys(module: nn.Module, state: dict, prefix: str, *_, names: tuple[str, ...], fused: str) -> None:
    """A checkpoint's separate projections (q/k/v_proj, gate/up_proj), loaded as the one `fused`."""
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{n}.{kind}" for n in names]
        if all(k in state for k in keys):
            state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(k) for k in keys])


def _split_keys(module: nn.Module, state: dict, prefix: str, _meta, names: tuple[str, ...], fused: str,
                sizes: list[int]) -> None:
    """`fused` saved under the checkpoint's names (views: a saver makes them contiguous)."""
    for kind in ("weight", "bias"):
        whole = state.pop(f"{prefix}{fused}.{kind}", None)
        if whole is not None:
            for name, part in zip(names, whole.split(sizes)):
                state[f"{prefix}{name}.{kind}"] = part


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # gate and up in one weight: one GEMM and one activation launch where there were two and
        # two (kernels/norm.py); checkpoints keep their gate/up_proj names (the two hooks)
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.register_load_state_dict_pre_hook(partial(_fuse_keys, names=_GATE_UP, fused="gate_up_proj"))
        self.register_state_dict_post_hook(partial(_split_keys, names=_GATE_UP, fused="gate_up_proj",
                                                   sizes=[args.intermediate_size] * 2))
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if x.is_cuda:
            from ctxcache.kernels.norm import silu_mul
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, layer, pos, cache, rope, attn):
        x, mlp_out = self.forward_pending(x, None, layer, pos, cache, rope, attn)
        return x + mlp_out

    def forward_pending(self, x: torch.Tensor, pending: torch.Tensor | None, layer: int, pos: torch.Tensor,
                        cache: KVCache, rope: torch.Tensor, attn: AttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with the residual stream x + pending (pending: the last block's MLP output, not
        yet added; None: nothing) -> (the stream after the attention, this MLP's output). Each add
        happens inside the next norm's launch on the GPU (RMSNorm.add_forward)."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_forward(x, pending)
        x, normed = self.post_attention_layernorm.add_forward(
            x, self.self_attn(normed, layer, pos, cache, rope, attn))
        return x, self.mlp(normed)


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
