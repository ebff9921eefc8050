"""Issue 34: the HTTP front's refusals, all in OpenAI's error shape with the status the gRPC
front's code maps to; a FAILED build; body limits; drain; a client that leaves stops its decode."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest

from ctxcache.indexer.build_queue import Job
from ctxcache.errors import ResourceExhausted

from http_helpers import assert_error_shape, in_process, tiny_http_config
from service_helpers import TEXT

USER = [{"role": "user", "content": "Where is the lighthouse?"}]
LIMIT = 64 << 10  # request bodies


@pytest.fixture(scope="module")
def server(tiny_lm, tmp_path_factory):
    cfg = tiny_http_config(tmp_path_factory.mktemp("edges") / "d", max_message_bytes=LIMIT)
    cfg = replace(cfg, decoder=replace(cfg.decoder, max_tokens_limit=1000))
    with in_process(tiny_lm, cfg) as (srv, base):
        with httpx.Client(base_url=base, timeout=60) as http:
            cid = http.post("/v1/cached_contents", json={"text": TEXT, "wait": True}).json()["id"]
            yield srv, http, cid


def refused(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = assert_error_shape(r)
    assert param is None or err["param"] == param, err
    return err


@pytest.mark.parametrize("field, value", [("n", 2), ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                          ("logprobs", True), ("top_logprobs", 3), ("presence_penalty", 0.5),
                                          ("response_format", {"type": "json_object"}), ("logit_bias", {"1": 5})])
def test_unsupported_chat_fields_are_400_naming_them(server, field, value):
    _, http, cid = server
    err = refused(http.post("/v1/chat/completions", json={"cached_content": cid, "messages": USER, field: value}),
                  400, field)
    assert "supported" in err["message"]


def test_bad_values_name_their_field(server):
    _, http, cid = server
    ask = {"cached_content": cid, "messages": USER}
    refused(http.post("/v1/chat/completions", json={**ask, "temperature": 1000}), 400, "temperature")
    refused(http.post("/v1/chat/completions", json={**ask, "max_tokens": 5000}), 400, "max_tokens")
    refused(http.post("/v1/chat/completions", json={**ask, "stop": [""]}), 400, "stop[0]")
    refused(http.post("/v1/chat/completions", json={**ask, "cached_content": "abc"}), 400, "cached_content")
    refused(http.post("/v1/chat/completions", json={**ask, "messages": [{"role": "tool", "content": "x"}]}), 400,
            "messages.0.role")
    refused(http.post("/v1/chat/completions", json={**ask, "messages": [{"role": "user", "content": " "}]}), 400,
            "messages[0].content")
    refused(http.post("/v1/chat/completions", json={**ask, "messages": [*USER, {"role": "assistant",
                                                                                 "content": "x"}]}), 400, "messages")
    refused(http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}),
            400)
    refused(http.post("/v1/completions", json={"prompt": ["a", "b"], "cached_content": cid}), 400, "prompt")
    refused(http.post("/v1/cached_contents", json={"text": "x", "documents": [{"text": "y"}]}), 400, "content")
    refused(http.post("/v1/cached_contents", json={"text": "x", "codec": "int3"}), 400, "codec")
    refused(http.post("/v1/cached_contents", json={"text": "x", "ttl": "soon"}), 400, "ttl")
    refused(http.post("/v1/cached_contents", json={"text": "x", "method": {"name": "nope"}}), 400, "method.name")
    refused(http.get("/v1/cached_contents", params={"page_size": 5000}), 400, "page_size")
    refused(http.get("/v1/cached_contents/" + "0" * 64), 404)
    refused(http.get("/v1/no/such"), 404)
    refused(http.put("/v1/chat/completions", json={}), 405)
    refused(http.get("/v1/models/gpt-4"), 404)


def test_a_failed_build_says_failed_and_why(tiny_lm, tmp_path):
    cfg = tiny_http_config(tmp_path / "d")
    cfg = replace(cfg, indexer=replace(cfg.indexer, build_timeout_s=1e-3))
    with in_process(tiny_lm, cfg) as (_, base):
        made = httpx.post(f"{base}/v1/cached_contents", json={"text": TEXT, "wait": True}, timeout=60).json()
        assert made["state"] == "FAILED" and "time bound" in made["error"], made
        got = httpx.get(f"{base}/v1/cached_contents/{made['name']}", timeout=60).json()
        assert got["state"] == "FAILED" and got["error"] == made["error"]
        r = httpx.post(f"{base}/v1/chat/completions", json={"cached_content": made["id"], "messages": USER}, timeout=60)
        refused(r, 404)


def test_bodies_over_the_limit_are_413(server):
    _, http, cid = server
    big = {"cached_content": cid, "messages": [{"role": "user", "content": "x" * LIMIT}]}
    refused(http.post("/v1/chat/completions", json=big), 413)

    def chunks():
        for _ in range(3):
            yield b"x" * (LIMIT // 2)
    refused(http.post("/v1/chat/completions", content=chunks()), 413)  # no Content-Length: counted


def test_draining_answers_503(server):
    srv, http, cid = server
    srv.draining.set()
    try:
        assert http.get("/health").status_code == 503
        refused(http.post("/v1/chat/completions", json={"cached_content": cid, "messages": USER}), 503)
    finally:
        srv.draining.clear()
    assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_stops_its_decode(server, stream, monkeypatch):
    srv, http, cid = server
    before = srv.metrics.generated_tokens._value.get()
    # the client must leave mid-decode: the tiny model's answer (417 tokens to a full cache, no
    # end token met) took ~3 s in this module alone but under 0.5 s in the full suite, so each
    # step is made to take 5 ms at least (>= 2 s), and the end token cannot stop it early either
    monkeypatch.setattr(type(srv.decoder.prompter), "stop_token_ids", property(lambda self: ()))
    engine = srv.decoder.engines[-1]  # the reference runner's (there is no GPU)
    step, steps = engine.runner.step, []

    def slow_step(rows, tokens):
        steps.append(time.sleep(0.005))
        return step(rows, tokens)
    monkeypatch.setattr(engine.runner, "step", slow_step)
    ask = {"cached_content": cid, "messages": USER, "stream": stream, "temperature": 0}  # max_tokens: the room left
    if stream:
        with http.stream("POST", "/v1/chat/completions", json=ask) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the opening chunk: decoding is under way
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while the server decodes
            r = http.post("/v1/chat/completions", json=ask, timeout=0.5)
            body = r.json()
            pytest.fail(f"answered within 0.5 s, so the client never left mid-decode: {r.status_code} "
                        f"{body.get('choices', [{}])[0].get('finish_reason')} {body.get('usage')}")
    end = time.monotonic() + 10
    while srv.decoder.active and time.monotonic() < end:
        time.sleep(0.01)
    assert srv.decoder.active == 0 and steps  # the decode ran through the slowed steps
    time.sleep(0.2)
    # an abandoned stream ends without its Final: it never counts its tokens as generated
    assert srv.metrics.generated_tokens._value.get() == before



def test_automatic_match_still_building_is_answered_as_a_miss(server, monkeypatch):
    """The tiny model builds in milliseconds, so the store is made to say "not yet" while the
    build queue says BUILDING for every id the lookup asks about: the prompt is decoded whole."""
    srv, http, _ = server
    ix = srv.indexer
    monkeypatch.setattr(ix.backend, "manifest", lambda cid: None)
    monkeypatch.setattr(ix, "job", lambda cid: Job(cid, None, [], stage=0.5))
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": TEXT}, *USER],
                                                "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.text
    assert r.json()["cached_content"] is None


def test_automatic_lookup_tokenizes_a_message_list_once(server, monkeypatch):
    srv, http, cid = server
    calls, real = [], srv.indexer.prompter.context_tokens
    monkeypatch.setattr(srv.indexer.prompter, "context_tokens", lambda m: calls.append(len(m)) or real(m))
    ask = {"messages": [{"role": "system", "content": TEXT}, *USER], "max_tokens": 1}
    first = http.post("/v1/chat/completions", json=ask).json()
    seen = len(calls)  # 0 when an earlier test asked with these messages already
    again = http.post("/v1/chat/completions", json=ask).json()
    assert first["cached_content"] == again["cached_content"] == cid and len(calls) == seen <= 1
    other = {**ask, "messages": [{"role": "system", "content": TEXT + " Other."}, *USER]}
    answers = [http.post("/v1/chat/completions", json=other).json() for _ in range(2)]
    assert [a["cached_content"] for a in answers] == [None, None]  # misses (too short to be registered)
    assert len(calls) == seen + 1  # one split, tokenized once (the lookup's and the registration's)


def test_a_miss_whose_prefix_cannot_be_built_is_answered_alone(tiny_lm, tmp_path, monkeypatch):
    """The registration is refused (queue full) or its build fails: the prompt is decoded whole,
    as it would be with no cache, and says so (no context, nothing cached)."""
    cfg = tiny_http_config(tmp_path / "d", auto_cache_min_tokens=256)
    cfg = replace(cfg, indexer=replace(cfg.indexer, build_timeout_s=1e-3))  # every build fails its time bound
    with in_process(tiny_lm, cfg) as (srv, base):
        with httpx.Client(base_url=base, timeout=60) as http:
            ask = {"messages": [{"role": "system", "content": TEXT}, *USER], "max_tokens": 2}
            failed = http.post("/v1/chat/completions", json=ask)
            assert failed.status_code == 200 and failed.json()["cached_content"] is None, failed.text
            assert failed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert srv.indexer.counts() == (0, 1)  # (building, failed): its prefix's build was tried and failed

            for refusal in (ResourceExhausted("64 builds queued; retry later"), RuntimeError("a bug")):
                def refuse(*_a, _exc=refusal, **_k):
                    raise _exc
                monkeypatch.setattr(srv.indexer, "submit", refuse)
                text = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 2})
                assert text.status_code == 200 and text.json()["cached_content"] is None, text.text
                assert text.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert http.post("/v1/chat/completions", json=ask).json()["cached_content"] is None
