"""Issue 48: what a client switching from OpenAI or vLLM sends, with the official `openai` client
against a real `ctxcache serve --http-port` process (the random tiny model: a 1,024-token window,
a byte tokenizer, builds and decodes in milliseconds): model names, malformed JSON, max_tokens
and temperature bounds, vLLM's sampling extras, /tokenize, /detokenize and /version."""

from __future__ import annotations

import httpx
import openai
import pytest

from service_helpers import TEXT

from http_helpers import assert_error_shape, serve_process

WINDOW = 1024  # random:tiny's max_seq_len
FLAGS = ["--model", "random:tiny", "--method", "key-kmeans"]
USER = [{"role": "user", "content": "Where is the lighthouse?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    with serve_process([*FLAGS, "--data", str(tmp / "d")], tmp / "serve.log") as (_, base):
        yield base


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def cid(oai) -> str:
    made = oai.post("/cached_contents", body={"text": TEXT, "wait": True}, cast_to=object)
    assert made["state"] == "READY", made
    return made["id"]


def ask(oai, cid: str, **kw):
    kw = {"model": "random:tiny", "messages": USER, "temperature": 0, "extra_body": {"cached_content": cid}, **kw}
    return oai.chat.completions.create(**kw)


def test_model_is_checked_against_the_served_names(oai, cid):
    ids = [m.id for m in oai.models.list().data]
    assert ids[0] == "random:tiny:seed0" and "random:tiny" in ids  # the id, then the name serve was given
    for name in ids:
        assert oai.models.retrieve(name).id == name
        assert ask(oai, cid, model=name, max_tokens=1).model == name
    with pytest.raises(openai.NotFoundError) as got:
        ask(oai, cid, model="gpt-4o", max_tokens=1)
    err = got.value.body
    assert got.value.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", err
    assert "gpt-4o" in err["message"] and "random:tiny" in err["message"]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="x", extra_body={"cached_content": cid})
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_malformed_json_names_its_line_and_column(server):
    body = b'{"model": "random:tiny",\n "messages": [{"role": "user", "content": "hi"},]}'
    r = httpx.post(f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = assert_error_shape(r)
    assert err["param"] is None and err["code"] == "invalid_json", err
    assert "line 2, column 49" in err["message"], err  # the "]" after the trailing comma, as json.loads says


def test_max_tokens_defaults_to_the_room_left(oai, cid):
    whole = ask(oai, cid)  # no max_tokens: the window's room, not a fixed 128
    assert whole.choices[0].finish_reason == "length" and whole.usage.total_tokens == WINDOW, whole.usage
    assert whole.usage.completion_tokens > 128


def test_max_tokens_past_the_window_is_400_up_front(oai, cid):
    prompt = ask(oai, cid, max_tokens=1).usage.prompt_tokens
    assert ask(oai, cid, max_tokens=WINDOW - prompt).usage.total_tokens == WINDOW  # exactly fits
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as got:
            ask(oai, cid, **{field: WINDOW - prompt + 1})
        assert got.value.body["param"] == "max_tokens" and str(WINDOW) in got.value.body["message"], got.value.body
    with pytest.raises(openai.BadRequestError) as got:
        oai.completions.create(model="random:tiny", prompt="x", max_tokens=WINDOW, extra_body={"cached_content": cid})
    assert got.value.body["param"] == "max_tokens"


def test_temperature_outside_0_to_2_is_400(oai, cid):
    assert ask(oai, cid, max_tokens=1, temperature=2).choices
    for t in (2.01, 5, -0.5):
        with pytest.raises(openai.BadRequestError) as got:
            oai.chat.completions.create(model="random:tiny", messages=USER, temperature=t, max_tokens=1,
                                        extra_body={"cached_content": cid})
        assert got.value.body["param"] == "temperature", got.value.body


@pytest.mark.parametrize("field, value", [("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2),
                                          ("min_tokens", 4), ("ignore_eos", True)])
def test_vllm_sampling_extras_are_refused_unless_neutral(oai, cid, field, value):
    with pytest.raises(openai.BadRequestError) as got:
        ask(oai, cid, max_tokens=1, extra_body={"cached_content": cid, field: value})
    assert got.value.body["param"] == field and "not supported" in got.value.body["message"], got.value.body
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="random:tiny", prompt="x", max_tokens=1,
                               extra_body={"cached_content": cid, field: value})


def test_vllm_sampling_extras_at_their_neutral_values_are_answered(oai, cid):
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False}
    plain = ask(oai, cid, max_tokens=4)
    same = oai.chat.completions.create(model="random:tiny", messages=USER, temperature=0, max_tokens=4,
                                       extra_body={"cached_content": cid, **neutral})
    assert same.choices[0].message.content == plain.choices[0].message.content


def test_tokenize_detokenize_and_version(server):
    text = "Where is the lighthouse?"
    with openai.OpenAI(base_url=server, api_key="unused", max_retries=0) as root:  # vLLM's paths have no /v1
        got = root.post("/tokenize", body={"model": "random:tiny", "prompt": text}, cast_to=object)
        assert got["count"] == len(got["tokens"]) == len(text.encode()) and got["max_model_len"] == WINDOW, got
        assert root.post("/detokenize", body={"tokens": got["tokens"]}, cast_to=object) == {"prompt": text}
        chat = root.post("/tokenize", body={"messages": USER, "return_token_strs": True}, cast_to=object)
        assert chat["count"] > got["count"] and len(chat["token_strs"]) == chat["count"], chat
        assert text in "".join(chat["token_strs"])
        with pytest.raises(openai.BadRequestError) as bad:
            root.post("/detokenize", body={"tokens": [0, 10**6]}, cast_to=object)
        assert bad.value.body["param"] == "tokens[1]", bad.value.body
        with pytest.raises(openai.NotFoundError) as missing:
            root.post("/tokenize", body={"prompt": "x", "model": "gpt-4o"}, cast_to=object)
        assert missing.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            root.post("/tokenize", body={}, cast_to=object)
        version = root.get("/version", cast_to=object)
    assert set(version) == {"version"} and version["version"][0].isdigit()
