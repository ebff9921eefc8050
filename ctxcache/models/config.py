"""Model hyper-parameters: one frozen dataclass, plus the named configs used for speed work."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2/Qwen3, SmolLM2)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head before RoPE
    # Llama-3.1 frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    rope_llama3_scaling: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name}={getattr(self, name)} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def to_dict(self) -> dict:
        return asdict(self)

    def differences(self, stored: dict[str, Any]) -> list[str]:
        """How `stored` (model_args as an artifact recorded them, e.g. after a JSON round trip)
        differs from these args: one 'field: stored X, running Y' per field. Both sides are
        compared in their JSON form, where a tuple and the list it was stored as are equal."""
        mine, theirs = _canonical(self.to_dict()), _canonical(stored)
        return [f"{k}: stored {theirs.get(k, '<absent>')!r}, running {mine.get(k, '<absent>')!r}"
                for k in sorted(set(mine) | set(theirs)) if mine.get(k, _ABSENT) != theirs.get(k, _ABSENT)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArgs":
        """Inverse of to_dict, also of its JSON form (lists back to tuples); unknown keys refused."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"ModelArgs has no fields {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


_ABSENT = object()


def _canonical(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, sort_keys=True))


NAMED_CONFIGS: dict[str, ModelArgs] = {
    # Random-weight shapes for GPU speed work; fidelity is measured on real models only.
    "llama-3.1-8b": ModelArgs(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate_size=14336, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
        rope_llama3_scaling=(8.0, 1.0, 4.0, 8192)),
    "smollm2-135m": ModelArgs(
        vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
        intermediate_size=1536, rope_theta=100000.0, norm_eps=1e-5, max_seq_len=8192,
        tie_embeddings=True),
    # Small enough for unit tests on CPU.
    "tiny": ModelArgs(
        vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
        intermediate_size=256, rope_theta=10000.0, max_seq_len=1024),
    # tiny with Llama-3.1 rope scaling (original length inside max_seq_len, so it bites)
    "tiny-llama3": ModelArgs(
        vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
        intermediate_size=256, rope_theta=10000.0, max_seq_len=1024,
        rope_llama3_scaling=(8.0, 1.0, 4.0, 256)),
}
