"""Rotary position embeddings (the rotate-half convention of Hugging Face Llama checkpoints)."""

from __future__ import annotations

import math

import torch

from ctxcache.models.config import ModelArgs


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3.1 scaling when the config asks for it."""
    half = args.head_dim // 2
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    if args.rope_llama3_scaling is None:
        return inv
    factor, low, high, original = args.rope_llama3_scaling
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(middle, (1 - smooth) * inv / factor + smooth * inv, scaled)


def rope_table(args: ModelArgs, device: torch.device | str = "cpu") -> torch.Tensor:
    """cos/sin table [max_seq_len, 2, head_dim/2] in float32."""
    pos = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(pos, rope_frequencies(args))
    return torch.stack([angles.cos(), angles.sin()], dim=1).float().to(device)


def apply_rope(x: torch.Tensor, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the angles of positions pos [B, T]."""
    cs = table[pos]  # [B, T, 2, D/2]
    cos = cs[:, None, :, 0].to(x.dtype)
    sin = cs[:, None, :, 1].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
