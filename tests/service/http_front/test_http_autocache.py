"""Issue 48: every chat and completions request is answered, and a missed chat's long leading
messages become a context of its tenant before it is answered, so the next request with them is
a hit. The official `openai` client against a real `ctxcache serve --http-port` process (the
random tiny model, a byte tokenizer: TEXT's system message is 565 tokens), under the server's
default flags (int8 K/V; auto decode mode, dense on a CPU). A hit must give exactly the miss's
greedy tokens, there and with `--decode-mode sparse` (what auto picks on a GPU), where a miss
decoded over exact K/V gave other tokens than the hit's sparse decode over int8 K/V. A raw-text
completion's prefix is cut at a 128-token block (the byte tokenizer: a prompt's tokens are its
bytes)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from service_helpers import TEXT

from http_helpers import serve_process

MIN = 256  # --auto-cache-min-tokens
SYSTEM_TOKENS = 565  # TEXT as the system message, rendered by the byte tokenizer's template
FLAGS = ["--model", "random:tiny", "--auto-cache-min-tokens", str(MIN), "--tenant-tokens",
         "tokA=acme,tokB=bolt,tokC=cove,tokD=dune,tokE=echo,tokF=fjord"]
QUESTION = {"role": "user", "content": "Where is the lighthouse?"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autocache")
    with serve_process([*FLAGS, "--data", str(tmp / "d")], tmp / "serve.log") as (_, url):
        yield url


@pytest.fixture(scope="module")
def sparse_base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autocache-sparse")
    with serve_process([*FLAGS, "--decode-mode", "sparse", "--data", str(tmp / "d")], tmp / "serve.log") as (_, url):
        yield url


@pytest.fixture(params=["base", "sparse_base"])
def any_base(request) -> str:
    """The defaults on this CPU (dense), and sparse decoding as the defaults give it on a GPU."""
    return request.getfixturevalue(request.param)


def client(base: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0, timeout=120)


def ask(oai: openai.OpenAI, messages: list[dict], **kw):
    return oai.chat.completions.create(model="random:tiny", messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True}, **kw)


def contexts(oai: openai.OpenAI) -> list[dict]:
    return oai.get("/cached_contents", cast_to=object)["cached_contents"]


def wait_ready(oai: openai.OpenAI, n: int = 1) -> list[dict]:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        listed = contexts(oai)
        if len(listed) >= n and all(c["state"] == "READY" for c in listed):
            return listed
        time.sleep(0.05)
    pytest.fail(f"no READY automatic context: {contexts(oai)}")


def test_a_prompt_never_registered_is_answered(base):
    with client(base, "tokC") as oai:
        whole = ask(oai, [QUESTION])
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
        assert whole.usage.prompt_tokens_details.cached_tokens == 0 and whole.model_extra["cached_content"] is None
        chunks = list(ask(oai, [QUESTION], stream=True, stream_options={"include_usage": True}))
        assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])] == \
            whole.choices[0].model_extra["token_ids"]
        assert chunks[-1].usage == whole.usage
        text = oai.completions.create(model="random:tiny", prompt="The harbour of", max_tokens=5, temperature=0)
        assert text.usage.completion_tokens == 5 and text.usage.prompt_tokens == len("The harbour of")
        assert text.usage.prompt_tokens_details.cached_tokens == 0
        assert contexts(oai) == []  # a lone user message has no leading messages to cache


def test_the_same_prefix_again_is_a_hit_with_the_same_greedy_tokens(any_base):
    messages = [{"role": "system", "content": TEXT}, QUESTION]
    with client(any_base, "tokA") as oai:
        miss = ask(oai, messages)
        assert miss.usage.prompt_tokens_details.cached_tokens == 0  # built for it: nothing was saved
        (made,) = wait_ready(oai)
        assert made["usage_metadata"]["total_token_count"] == SYSTEM_TOKENS and made["expire_time"], made
        hit = ask(oai, messages)
        assert hit.usage.prompt_tokens_details.cached_tokens >= SYSTEM_TOKENS
        assert hit.model_extra["cached_content"] == made["id"] and hit.usage.prompt_tokens == miss.usage.prompt_tokens
        assert hit.choices[0].model_extra["token_ids"] == miss.choices[0].model_extra["token_ids"]
        assert miss.model_extra["cached_content"] == made["id"]  # why: the miss was decoded over it too
        # a later turn of the same chat: the registered context is its prefix, the rest is prefilled
        later = [*messages, {"role": "assistant", "content": hit.choices[0].message.content}, QUESTION]
        turn = ask(oai, later, stream=True, stream_options={"include_usage": True})
        usage = list(turn)[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == SYSTEM_TOKENS < usage.prompt_tokens


def test_concurrent_misses_with_one_prefix_share_its_build_and_answer_alike(base):
    messages = [{"role": "system", "content": TEXT + " The Needle is red."}, QUESTION]
    with client(base, "tokC") as oai, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: ask(oai, messages), range(3)))
        (made,) = wait_ready(oai)  # answered from the build, maybe before its write landed
        assert {a.model_extra["cached_content"] for a in answers} == {made["id"]}
        assert len({tuple(a.choices[0].model_extra["token_ids"]) for a in answers}) == 1


def test_a_prefix_shorter_than_the_minimum_is_not_registered(base):
    short = [{"role": "system", "content": TEXT[:MIN - 60]}, QUESTION]  # < MIN tokens with its template
    with openai.OpenAI(base_url=base, api_key="tokB", max_retries=0) as root:  # /tokenize: vLLM's, at the root
        assert root.post("/tokenize", body={"messages": short[:1], "add_generation_prompt": False},
                         cast_to=object)["count"] < MIN
    with client(base, "tokB") as oai:
        for _ in range(2):
            assert ask(oai, short).usage.prompt_tokens_details.cached_tokens == 0
            time.sleep(0.5)  # a registration would be submitted by now and built in milliseconds
        assert contexts(oai) == []


def test_tenants_never_see_each_others_automatic_contexts(base):
    messages = [{"role": "system", "content": TEXT + " The Needle is white."}, QUESTION]
    with client(base, "tokA") as a, client(base, "tokB") as b:
        seen_a, seen_b = {c["id"] for c in contexts(a)}, {c["id"] for c in contexts(b)}
        ask(a, messages)
        mine = {c["id"] for c in wait_ready(a, len(seen_a) + 1)} - seen_a
        assert len(mine) == 1 and ask(a, messages).usage.prompt_tokens_details.cached_tokens > 0
        assert ask(b, messages).usage.prompt_tokens_details.cached_tokens == 0  # A's context is not B's
        assert not mine & {c["id"] for c in contexts(b)}
        theirs = {c["id"] for c in wait_ready(b, len(seen_b) + 1)} - seen_b  # B's miss made B's own
        assert len(theirs) == 1 and not theirs & mine
        assert ask(b, messages).model_extra["cached_content"] in theirs


def test_auto_cache_off(tmp_path):
    flags = [f for f in FLAGS if f not in ("--auto-cache-min-tokens", str(MIN))]
    with serve_process([*flags, "--no-auto-cache", "--data", str(tmp_path / "d")], tmp_path / "log") as (_, url):
        with client(url, "tokA") as oai:
            messages = [{"role": "system", "content": TEXT}, QUESTION]
            assert ask(oai, messages).usage.prompt_tokens_details.cached_tokens == 0
            time.sleep(0.5)
            assert ask(oai, messages).usage.prompt_tokens_details.cached_tokens == 0 and contexts(oai) == []
            for _ in range(2):
                assert complete(oai, TEXT).usage.prompt_tokens_details.cached_tokens == 0
                time.sleep(0.5)
            assert contexts(oai) == []


BLOCK = 128  # raw_prefix.BLOCK
PROMPT = TEXT + " Where is the Needle?"
PREFIX = (len(PROMPT) - 1) // BLOCK * BLOCK  # 512: at least one token follows the cached prefix


def complete(oai: openai.OpenAI, prompt: str, **kw):
    return oai.completions.create(model="random:tiny", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True}, **kw)


def test_a_completion_prefix_is_registered_at_a_token_block_and_reused(any_base):
    assert PREFIX == 512 and len(PROMPT) > PREFIX
    with client(any_base, "tokD") as oai:
        miss = complete(oai, PROMPT)
        assert miss.usage.prompt_tokens_details.cached_tokens == 0
        (made,) = wait_ready(oai)
        assert made["usage_metadata"]["total_token_count"] == PREFIX and made["expire_time"], made
        hit = complete(oai, PROMPT)
        assert hit.usage.prompt_tokens_details.cached_tokens == PREFIX and hit.model_extra["cached_content"] == made["id"]
        assert hit.usage.prompt_tokens == miss.usage.prompt_tokens == len(PROMPT)
        assert hit.choices[0].model_extra["token_ids"] == miss.choices[0].model_extra["token_ids"]
        assert miss.model_extra["cached_content"] == made["id"]  # why: the miss was decoded over it too
        # a longer prompt (its own longest block is 768) sharing the prefix: the 512 are reused, streamed too
        longer = PROMPT + TEXT[:200]
        chunks = list(complete(oai, longer, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == PREFIX and usage.prompt_tokens == len(longer)
        assert [c["id"] for c in contexts(oai)] == [made["id"]]  # a hit registers nothing more


def test_a_completion_prefix_shorter_than_the_minimum_is_not_registered(base):
    under, at = TEXT[1:MIN + 1], TEXT[2:MIN + 3]  # 256 tokens: a 128-token prefix; 257: a 256-token one
    with client(base, "tokE") as oai:
        for _ in range(2):
            assert complete(oai, under).usage.prompt_tokens_details.cached_tokens == 0
            time.sleep(0.5)  # a registration would be submitted by now and built in milliseconds
        assert contexts(oai) == []
        complete(oai, at)
        (made,) = wait_ready(oai)
        assert made["usage_metadata"]["total_token_count"] == MIN
        assert complete(oai, at).usage.prompt_tokens_details.cached_tokens == MIN


def test_tenants_never_see_each_others_completion_prefixes(base):
    prompt = "Tenant F asks: " + PROMPT
    with client(base, "tokD") as d, client(base, "tokF") as f:
        seen_d = {c["id"] for c in contexts(d)}
        complete(d, prompt)
        mine = {c["id"] for c in wait_ready(d, len(seen_d) + 1)} - seen_d
        assert len(mine) == 1 and complete(d, prompt).usage.prompt_tokens_details.cached_tokens == PREFIX
        assert complete(f, prompt).usage.prompt_tokens_details.cached_tokens == 0  # D's context is not F's
        theirs = {c["id"] for c in wait_ready(f)}  # F's miss made F's own
        assert len(theirs) == 1 and not theirs & mine
        again = complete(f, prompt)
        assert again.model_extra["cached_content"] in theirs and again.usage.prompt_tokens_details.cached_tokens == PREFIX
