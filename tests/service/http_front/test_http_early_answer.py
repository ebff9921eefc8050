"""A miss is answered from its prefix's built artifact before the store write lands (early.py):
an in-process server (random tiny model) over an object store (file://), whose write is held at
`finish` by a gate the test opens. The first token must come while the write is held; the
context is READY only once it is written; a later hit gives the miss's tokens; a write that
fails after the answer leaves no context and, after GC, no chunks. The gate opens by itself
after HELD_S, so the code before this change (the miss waited for the write) fails these
tests instead of hanging."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from ctxcache.store.errors import StoreUnavailable

from http_helpers import in_process, tiny_http_config
from service_helpers import TEXT

HELD_S = 20.0  # the gate's own timeout: far beyond an early answer (well under a second here)
QUESTION = {"role": "user", "content": "Where is the lighthouse?"}


class GatedWrites:
    """Wraps the backend's writers: `finish` waits for the gate, then writes, or fails when told
    to (the real writer is then aborted by the build queue, as after any failed upload)."""

    def __init__(self, backend) -> None:  # noqa: ANN001 - service Backend
        self.backend, self.real = backend, backend.writer
        self.gate, self.fail = threading.Event(), False
        self.started = self.finished = 0
        self.opened_at: float | None = None
        backend.writer = self.writer

    def writer(self, cid, meta):  # noqa: ANN001, ANN201
        inner, gated = self.real(cid, meta), self

        class Gated:
            def add_layer(self, *args, **kw) -> None:
                inner.add_layer(*args, **kw)

            def finish(self, art):  # noqa: ANN001, ANN201
                gated.started += 1
                gated.gate.wait(HELD_S)
                if gated.opened_at is None:
                    gated.opened_at = time.monotonic()
                if gated.fail:
                    raise StoreUnavailable("injected: the object store went away")
                m = inner.finish(art)
                gated.finished += 1
                return m

            def abort(self) -> None:
                inner.abort()
        return Gated()

    def open(self, fail: bool = False) -> None:
        self.fail, self.opened_at = fail, time.monotonic()
        self.gate.set()


@pytest.fixture
def server(tiny_lm, tmp_path: Path):
    cfg = tiny_http_config(tmp_path / "d", auto_cache_min_tokens=256)
    cfg = replace(cfg, store=replace(cfg.store, object_store_uri=f"file://{tmp_path / 'shared'}"))
    with in_process(tiny_lm, cfg) as (srv, base):
        yield srv, base, GatedWrites(srv.backend), tmp_path / "shared"


def ask(base: str, messages: list[dict]) -> dict:
    body = {"model": "random:tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def first_token_then_rest(base: str, messages: list[dict]) -> tuple[float, list[int]]:
    """A streamed miss -> (when its first token came, all its token ids)."""
    body = {"model": "random:tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": True,
            "return_token_ids": True}
    first, ids = None, []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            ids += (choices[0].get("token_ids") or []) if choices else []
            if ids and first is None:
                first = time.monotonic()
    assert first is not None and ids
    return first, ids


def wait_ready(srv, cid: str) -> None:  # noqa: ANN001 - the server
    end = time.monotonic() + 30
    while srv.backend.manifest(cid) is None:
        assert time.monotonic() < end, f"{cid[:12]} not READY"
        time.sleep(0.05)


def context_of(answer: dict) -> str:
    cid = answer["cached_content"]
    assert cid, answer
    return cid


def test_the_miss_answers_before_its_write_lands_and_a_hit_gives_its_tokens(server):
    srv, base, writes, _ = server
    messages = [{"role": "system", "content": TEXT}, QUESTION]
    _, miss_ids = first_token_then_rest(base, messages)
    assert writes.opened_at is None and writes.finished == 0 and writes.started == 1  # answered while held
    miss = ask(base, messages)  # joins the same build (still writing), answered from it as well
    cid = context_of(miss)
    assert writes.started == 1 and writes.finished == 0 and miss["choices"][0]["token_ids"] == miss_ids
    assert srv.backend.manifest(cid) is None  # not READY (nor visible) until its manifest lands
    writes.open()
    wait_ready(srv, cid)
    end = time.monotonic() + 10
    while cid not in srv.decoder.cache:  # once stored, the DRAM cache holds the build's artifact
        assert time.monotonic() < end, "the stored artifact was not kept in DRAM"
        time.sleep(0.02)
    gets: list[str] = []
    real_get = srv.backend.store.get
    srv.backend.store.get = lambda c, *a: gets.append(c) or real_get(c, *a)
    hit = ask(base, messages)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and context_of(hit) == cid
    assert hit["choices"][0]["token_ids"] == miss_ids
    assert gets == []  # the first hit loaded nothing back from the store, as after a miss before


def test_concurrent_misses_share_one_build_and_answer_before_the_write(server):
    _, base, writes, _ = server
    messages = [{"role": "system", "content": TEXT + " The Needle is red."}, QUESTION]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: first_token_then_rest(base, messages), range(3)))
    assert writes.opened_at is None and writes.started == 1  # one build, one write, all three answered
    assert len({tuple(ids) for _, ids in answers}) == 1
    writes.open()


def test_a_write_failing_after_the_early_answer_leaves_no_context_and_no_chunks(server):
    srv, base, writes, shared = server
    messages = [{"role": "system", "content": TEXT + " The Needle is green."}, QUESTION]
    miss = ask(base, messages)
    cid = context_of(miss)
    assert writes.opened_at is None  # answered while the write was held
    job = srv.indexer.job(cid)
    evicted: list[str] = []
    real_evict = srv.decoder.evict_device
    srv.decoder.evict_device = lambda c: evicted.append(c) or real_evict(c)
    assert [p for p in shared.rglob("*") if p.is_file() and cid in str(p)]  # layers' chunks went up
    writes.open(fail=True)
    assert job.done.wait(30) and job.state == "failed" and job.artifact is None
    assert srv.backend.manifest(cid) is None
    end = time.monotonic() + 10
    while not evicted and time.monotonic() < end:  # the runners keep no slot under its id
        time.sleep(0.02)
    assert evicted and set(evicted) == {cid}  # (the stream's end may look too)
    # the manifest never went up, and the layers' chunks that did are gone (abort, then GC)
    srv.backend.store.gc(grace_s=0)
    left = [p for p in shared.rglob("*") if p.is_file() and cid in str(p)]
    assert left == []
    # the same prefix again: a miss (nothing registered), built and written now, then a hit
    writes.gate, writes.fail, writes.opened_at = threading.Event(), False, None
    writes.gate.set()
    again = ask(base, messages)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and context_of(again) == cid
    wait_ready(srv, cid)
    hit = ask(base, messages)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert hit["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == miss["choices"][0]["token_ids"]


def test_a_completion_miss_answers_before_its_write_lands(server):
    srv, base, writes, _ = server
    prompt = TEXT + " Where is the Needle?"
    body = {"model": "random:tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    miss = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert writes.opened_at is None and writes.started == 1 and miss["choices"][0]["token_ids"]
    cid = context_of(miss)
    assert srv.backend.manifest(cid) is None
    writes.open()
    wait_ready(srv, cid)
    hit = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 512 and context_of(hit) == cid
    assert hit["choices"][0]["token_ids"] == miss["choices"][0]["token_ids"]
