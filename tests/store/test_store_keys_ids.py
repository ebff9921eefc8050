"""Typed keys round-trip and reject malformed input; content ids are stable and sensitive."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ctxcache.store.ids import context_id_for
from ctxcache.store.keys import AccessKey, BuildLockKey, ChunkKey, ManifestKey, PromptKey


@pytest.mark.parametrize("key", [ManifestKey("abc"), AccessKey("a.b-c_d"), ChunkKey("x", 0, "k"),
                                 ChunkKey("x", 29, "t_list_idx"), ChunkKey("x", None, "tokens"),
                                 PromptKey("f" * 64), BuildLockKey("p1")])
def test_keys_round_trip(key: object) -> None:
    text = key.to_string()
    assert text.startswith("ctxcache:v1:")
    assert type(key).from_string(text) == key


@pytest.mark.parametrize("cls, text", [
    (ManifestKey, "ctxcache:v2:manifest:abc"), (ManifestKey, "ctxcache:v1:chunk:abc"),
    (ManifestKey, "ctxcache:v1:manifest:"), (ManifestKey, "ctxcache:v1:manifest:a:b"),
    (ChunkKey, "ctxcache:v1:chunk:abc:01:k"), (ChunkKey, "ctxcache:v1:chunk:abc:-1:k"),
    (ChunkKey, "ctxcache:v1:chunk:abc:x:k"), (ChunkKey, "ctxcache:v1:chunk:abc:0:k-v"),
    (ChunkKey, "ctxcache:v1:chunk:abc:0"), (PromptKey, "ctxcache:v1:prompt:a b"),
    (BuildLockKey, "other:v1:build:abc"),
])
def test_malformed_keys_are_rejected(cls: type, text: str) -> None:
    with pytest.raises(ValueError):
        cls.from_string(text)


def test_bad_fields_are_rejected() -> None:
    for bad in ("", "a:b", "x" * 129, "é"):
        with pytest.raises(ValueError, match="context_id"):
            ManifestKey(bad)
    with pytest.raises(ValueError, match="layer"):
        ChunkKey("a", -1, "k")
    with pytest.raises(ValueError, match="chunk name"):
        ChunkKey("a", 0, "0abc")


BASE = dict(model_id="smollm2", tokenizer_id="smollm2-tok", template_id="chatml", kv_dtype="float16",
            format_version=1, method="csattention", params={"subspaces": 8, "list_fraction": 0.25},
            token_ids=[1, 2, 3, 70000], tenant="acme")


def test_context_id_is_stable_across_processes() -> None:
    here = context_id_for(**BASE)
    code = ("from ctxcache.store.ids import context_id_for; import sys; "
            f"sys.stdout.write(context_id_for(**{BASE!r}))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert here == there and len(here) == 64 and int(here, 16) >= 0
    same = dict(BASE, params={"list_fraction": 0.25, "subspaces": 8},
                token_ids=np.array([1, 2, 3, 70000], dtype=np.int32))
    assert context_id_for(**same) == here  # key order and int width do not matter


@pytest.mark.parametrize("field, value", [
    ("model_id", "other"), ("tokenizer_id", "t2"), ("template_id", "none"), ("kv_dtype", "bfloat16"),
    ("format_version", 2), ("method", "quest"), ("params", {"subspaces": 4, "list_fraction": 0.25}),
    ("token_ids", [1, 2, 3]), ("token_ids", [1, 2, 3, 70001]), ("tenant", "other"), ("kv_codec", "int8")])
def test_context_id_changes_with_every_field(field: str, value: object) -> None:
    assert context_id_for(**dict(BASE, **{field: value})) != context_id_for(**BASE)


def test_context_id_rejects_bad_tokens() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        context_id_for(**dict(BASE, token_ids=[[1, 2]]))
    with pytest.raises(ValueError, match="token_ids"):
        context_id_for(**dict(BASE, token_ids=[1.5]))
