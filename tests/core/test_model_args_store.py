"""Model args survive the store's JSON manifest: every named config and a real Hugging Face
Llama-3.1 config.json (rope scaling a tuple in ModelArgs, a list in JSON) decode after a round
trip through a real LMDB store, and a real mismatch names the field and both values."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ctxcache.decoder import ArtifactMismatch, SparseConfig, generate
from ctxcache.decoder.session import check_compatible
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.config import NAMED_CONFIGS, ModelArgs
from ctxcache.models.loader import LoadedModel, args_from_hf_config, load_model
from ctxcache.store import ArtifactStore, StoreConfig

# meta-llama/Llama-3.1-8B config.json, the fields the loader reads
HF_LLAMA31_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def _hf_llama31() -> ModelArgs:
    from transformers import LlamaConfig

    return args_from_hf_config(LlamaConfig(**HF_LLAMA31_CONFIG))


CONFIGS = {**{f"random:{k}": v for k, v in NAMED_CONFIGS.items()}, "hf:llama-3.1-8b": None}
QUIET = IndexerConfig(progress=False, kv_dtype="float32")


@pytest.fixture(scope="module")
def tiny_artifact():
    lm = load_model("random:tiny")
    return build_artifact(lm, list(range(1, 40)), make_method("key-kmeans"), QUIET)


def _round_trip(art, tmp_path: Path):
    with ArtifactStore(tmp_path / "store", StoreConfig(map_size_bytes=1 << 28, budget_bytes=1 << 28)) as s:
        s.put("ctx", art)
        return s.get("ctx")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_is_compatible_after_a_store_round_trip(name, tiny_artifact, tmp_path):
    args = CONFIGS[name] or _hf_llama31()
    art = dataclasses.replace(tiny_artifact, model_id=name, model_args=args.to_dict())
    got = _round_trip(art, tmp_path)
    assert ModelArgs.from_dict(got.model_args) == args  # the typed config comes back whole
    check_compatible(LoadedModel(SimpleNamespace(args=args), None, name), [got])


def test_hf_llama31_config_maps_to_the_named_shape():
    assert _hf_llama31() == NAMED_CONFIGS["llama-3.1-8b"]


def test_llama3_scaled_model_decodes_after_a_store_round_trip(tmp_path):
    lm = load_model("random:tiny-llama3")
    assert lm.args.rope_llama3_scaling is not None
    ids = torch.randint(0, lm.args.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    # lossless K/V: the round trip must change nothing the decode reads (the default int8 codec moves K by
    # ~0.004, and which of a random model's near-tied keys follow seeds may move with it)
    build = dataclasses.replace(QUIET, kv_codec="lossless")
    art = build_artifact(lm, ids, make_method("csattention", {"subspaces": 4, "centroids": 16}), build)
    got = _round_trip(art, tmp_path)
    config, sampling = SparseConfig(Budget(0.1, 2, 8)), SamplingParams(max_tokens=6)
    before = [t.tolist() for t, _ in generate(lm, [art], [[5, 6, 7]], sampling, config)]
    after = [t.tolist() for t, _ in generate(lm, [got], [[5, 6, 7]], sampling, config)]
    assert after == before and len(after) == 6


def test_a_real_mismatch_names_the_field_and_both_values(tiny_artifact):
    args = NAMED_CONFIGS["tiny-llama3"]
    stored = {**args.to_dict(), "rope_llama3_scaling": [8.0, 1.0, 2.0, 256]}
    art = dataclasses.replace(tiny_artifact, model_id="m", model_args=stored)
    with pytest.raises(ArtifactMismatch, match=r"rope_llama3_scaling: stored \[8.0, 1.0, 2.0, 256\], "
                                               r"running \[8.0, 1.0, 4.0, 256\]"):
        check_compatible(LoadedModel(SimpleNamespace(args=args), None, "m"), [art])
