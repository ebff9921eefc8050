"""Every registered method (and the paper's CSAttention, and pre-hoc with PSAW) through the
service: PutContext builds the artifact with that method, Generate decodes sparsely from it."""

from __future__ import annotations

import pytest
from google.protobuf.struct_pb2 import Struct

from ctxcache.methods import method_names
from ctxcache.client.gen.v1 import context_pb2 as pb

from service_helpers import ask, put_text

# listed here, not read from the registry: a method dropped from it (or never added) fails below
EXPECTED = ["csattention", "csattention-paper", "ctkvr", "key-kmeans", "magicpig", "multipole", "oracle",
            "prehoc", "quest"]
CASES = [(name, {}) for name in EXPECTED] + [("prehoc", {"psaw": True, "psaw_start": 0.0})]


def test_the_service_offers_exactly_the_expected_methods():
    assert method_names() == EXPECTED


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}{'-psaw' if p else ''}" for n, p in CASES])
def test_put_then_generate(start, name, params):
    srv, client = start()
    spec = pb.MethodSpec(name=name)
    if params:
        spec.params.CopyFrom(Struct())
        spec.params.update(params)
    info = put_text(client, method=spec)
    assert info.state == pb.CONTEXT_STATE_READY, info.error
    assert info.n_tokens > 100 and info.artifact_bytes > 0
    for key, value in params.items():
        assert info.method_params[key] == value
    _, final = ask(client, info.context_id, max_tokens=6)
    assert final.usage.cached_tokens == info.n_tokens
    assert 0 < final.usage.generated_tokens <= 6 and final.text
