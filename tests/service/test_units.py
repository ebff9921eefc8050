"""Unit tests of the pieces with no server: text streaming, the DRAM cache, prompt prefixes."""

from __future__ import annotations

import threading
import time

import pytest

from ctxcache.decoder.artifact_cache import ArtifactCache
from ctxcache.prompting import ByteTokenizer, Prompter, document_messages, text_messages
from ctxcache.decoder.textstream import TextStream


def _feed(stream: TextStream, text: str) -> str:
    out = ""
    for tok in ByteTokenizer().encode(text):
        out += stream.push(tok)
        if stream.stopped:
            break
    return out + stream.flush()


def test_multibyte_characters_are_never_split():
    stream, pieces = TextStream(ByteTokenizer()), []
    for tok in ByteTokenizer().encode("héllo 世界 🙂!"):
        pieces.append(stream.push(tok))
    assert "".join(pieces) == "héllo 世界 🙂!"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the 4-byte emoji waited for its last byte


@pytest.mark.parametrize("text,stops,expect", [
    ("answer: 42\nUser: more", ("\nUser:",), "answer: 42"),
    ("abcabd", ("abd",), "abc"),
    ("no stop here", ("zzz",), "no stop here"),
    ("cut 世界 here", ("界",), "cut 世"),
    ("xSTOPySTOP", ("STOP", "y"), "x"),
])
def test_stop_sequences_cut_before_the_first_match(text, stops, expect):
    stream = TextStream(ByteTokenizer(), stops)
    assert _feed(stream, text) == expect
    assert stream.stopped == (expect != text)


def test_held_back_prefix_of_a_stop_is_released_when_it_diverges():
    stream = TextStream(ByteTokenizer(), ("\nUser",))
    emitted = [stream.push(t) for t in ByteTokenizer().encode("a\nUs")]
    assert "".join(emitted) == "a"
    assert "".join(stream.push(t) for t in ByteTokenizer().encode("ed")) == "\nUsed"


def test_context_tokens_are_a_true_prefix_of_the_prompt():
    p = Prompter(ByteTokenizer())
    for ctx in (text_messages("some text"), document_messages([("t", "doc one"), ("", "doc two")])):
        ctx_ids = p.context_tokens(ctx)
        turn = [{"role": "user", "content": "q?"}]
        full = p.encode(p.render(ctx + turn, add_generation_prompt=True))
        assert full == ctx_ids + p.turn_tokens(ctx, turn)


def test_cache_lru_by_bytes_and_single_flight():
    loads = []

    def load(key: str) -> bytes:
        loads.append(key)
        time.sleep(0.05)
        return key.encode() * 10

    cache = ArtifactCache(25, load, len)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.acquire("a"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads == ["a"] and sum(not r.hit for r in results) == 1
    cache.acquire("b")
    assert "a" in cache and "b" in cache and cache.bytes == 20
    cache.acquire("c")  # 30 bytes > 25: the least recently used goes
    assert "a" not in cache and cache.bytes == 20
    held = cache.acquire("c").value
    assert cache.evict("c") == 10 and held == b"c" * 10  # a holder keeps its complete value
    assert cache.evict("c") == 0


def test_a_load_racing_an_evict_is_not_cached():
    gate = threading.Event()
    cache = ArtifactCache(100, lambda k: (gate.wait(5), b"x")[1], len)
    t = threading.Thread(target=cache.acquire, args=("k",))
    t.start()
    time.sleep(0.05)
    cache.evict("k")
    gate.set()
    t.join()
    assert "k" not in cache


def test_an_offered_value_is_held_unless_held_loading_invalid_or_evicted_meanwhile():
    """A build's artifact offered once stored (ArtifactCache.offer): an evict that comes after the
    caller's store check (a Delete: store first, then DRAM) wins, as over a racing load."""
    cache = ArtifactCache(100, lambda k: b"loaded", len)
    assert not cache.offer("a", b"built", lambda: False) and "a" not in cache  # not stored (any more)
    assert cache.offer("a", b"built", lambda: True) and cache.acquire("a").value == b"built"
    assert not cache.offer("a", b"other", lambda: True) and cache.acquire("a").value == b"built"
    assert not cache.offer("b", b"built", lambda: cache.evict("b") == 0) and "b" not in cache
    assert not cache.offer("c", b"x" * 101, lambda: True) and "c" not in cache  # over the capacity


def test_out_of_gpu_memory_is_resource_exhausted_in_one_line():
    import grpc
    import torch

    from ctxcache.service.errors import status_for

    code, text = status_for(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.75 GiB. GPU 0 has ..."))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert text == "out of GPU memory: CUDA out of memory" and "\n" not in text
    # the driver's own allocations fail as other errors: a kernel launch, a cuBLAS handle
    for exc in (torch.AcceleratorError("CUDA error: out of memory\nSearch for ..."),
                RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")):
        code, text = status_for(exc)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and text.startswith("out of GPU memory: CUDA error")


def test_a_tenant_reads_the_failing_part_an_admin_its_address():
    import grpc

    from ctxcache.errors import Unavailable, failure_text
    from ctxcache.service.errors import status_for
    from ctxcache.store import RegistryUnavailable, StoreUnavailable

    store = StoreUnavailable("object store s3://b/p?endpoint_override=10.1.2.3:8333: get v1/manifests/x: refused")
    registry = RegistryUnavailable("redis at 10.1.2.4:6379 is unavailable: Connection refused")
    wrapped = Unavailable("registry unavailable, cannot start a build", detail=registry)
    for exc, part in ((store, "object store unavailable"), (registry, "registry unavailable"),
                      (wrapped, "registry unavailable, cannot start a build")):
        code, tenant = status_for(exc)
        assert code == grpc.StatusCode.UNAVAILABLE and part in tenant and "10.1.2." not in tenant
        assert "10.1.2." in status_for(exc, admin=True)[1]
        assert "10.1.2." not in failure_text(exc)  # a failed build's error, shown by GetContext
