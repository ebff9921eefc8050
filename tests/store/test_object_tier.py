"""ObjectTier backends against a real folder and a real S3 server (SeaweedFS): bytes round-trip
exactly, absent keys are None, failures are StoreUnavailable, bad URIs one clear ValueError."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctxcache.store.errors import StoreUnavailable
from ctxcache.store.tiers import TierConfig, open_tier
from ctxcache.store.tiers.file import TEMP_MARK
from redis_server import free_port


@pytest.mark.parametrize("uri, words", [
    ("gs://bucket/p", ["'gs' is not supported", "s3://bucket/prefix", "file:///"]),
    ("bucket/p", ["scheme '' is not supported"]),
    ("s3://b/p?endpoint=127.0.0.1:1", ["unknown option(s) ['endpoint']"]),
    ("s3://key:secret@b/p", ["credentials in the environment"]),
    ("s3://b/p?scheme=ftp", ["scheme='ftp' must be http or https"]),
    ("s3://b/p?anonymous=maybe", ["anonymous='maybe' must be true or false"]),
    ("file://relative/path", ["must be file:///absolute/path"]),
    ("file:///tmp/x?a=1", ["must be file:///absolute/path"]),
])
def test_a_bad_uri_is_one_clear_error(uri: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        open_tier(uri)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_keys_outside_the_alphabet_are_refused(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}")
    for bad in ("../x", "a//b", "/a", "a b", "a/~x", ""):
        with pytest.raises(ValueError, match="object key"):
            tier.put(bad, b"x")


def test_get_into_reads_an_object_in_ranges_into_given_memory(tier_uri: str, monkeypatch) -> None:
    """A load reads each chunk straight into memory it owns (its tensor): ranges in parallel,
    on one handle per object; a size other than the one expected fills nothing and says the size."""
    import numpy as np

    from ctxcache.store.tiers import arrow

    monkeypatch.setattr(arrow, "RANGE_BYTES", 4096)
    tier = open_tier(tier_uri)
    blob = os.urandom(4096 * 5 + 77)  # 6 ranges, the last partial
    tier.put("v1/r/blob", blob)
    out = np.zeros(len(blob), np.uint8)
    assert tier.get_into("v1/r/blob", memoryview(out)) == len(blob) and out.tobytes() == blob
    short = np.zeros(len(blob) - 1, np.uint8)
    assert tier.get_into("v1/r/blob", memoryview(short)) == len(blob) and not short.any()
    assert tier.get_into("v1/r/none", memoryview(out)) is None
    assert bytes(tier.get("v1/r/blob")) == blob
    seen: list[tuple[int, int | None]] = []
    outs = [memoryview(np.zeros(len(blob), np.uint8)) for _ in range(2)]
    assert tier.get_many_into(["v1/r/blob", "v1/r/none"], outs, lambda i, n: seen.append((i, n))) == [len(blob), None]
    assert sorted(seen) == [(0, len(blob)), (1, None)] and outs[0].tobytes() == blob


def test_a_batch_reads_object_by_object_in_the_order_given(tier_uri: str, monkeypatch) -> None:
    """One pool of ranged reads, objects submitted in order (a load's layer 0 lands first): on
    one thread each object is opened, read whole and handed over before the next is opened."""
    import numpy as np

    from ctxcache.store.tiers import arrow

    monkeypatch.setattr(arrow, "RANGE_BYTES", 4096)
    tier = open_tier(tier_uri, TierConfig(read_threads=1))
    blobs = [os.urandom(4096 * 3 + i) for i in range(4)]
    keys = [f"v1/o/{i}" for i in range(4)]
    tier.put_many(list(zip(keys, blobs)))
    events: list[tuple[str, object]] = []
    real_open = tier.open_object
    tier.open_object = lambda key: events.append(("open", key)) or real_open(key)  # type: ignore[method-assign]
    outs = [memoryview(np.zeros(len(b), np.uint8)) for b in blobs]
    assert tier.get_many_into(keys, outs, lambda i, n: events.append(("then", i))) == [len(b) for b in blobs]
    assert events == [e for i, k in enumerate(keys) for e in (("open", k), ("then", i))]
    assert [o.tobytes() for o in outs] == blobs
    tier.close()


def test_an_object_that_cannot_be_opened_is_asked_once_and_unavailable(tmp_path: Path, monkeypatch) -> None:
    """Its ranges waiting on the open do not each ask the store again (a failing store sees one
    request per object, not one per range)."""
    import numpy as np

    from ctxcache.store.tiers import arrow

    monkeypatch.setattr(arrow, "RANGE_BYTES", 4096)
    tier = open_tier(f"file://{tmp_path}", TierConfig(read_threads=4))
    opens: list[str] = []

    def refused(key: str) -> object:
        opens.append(key)
        time.sleep(0.1)  # the object's other ranges wait on this open meanwhile
        raise OSError("connection refused")
    tier.open_object = refused  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable, match="v1/o/x: connection refused"):
        tier.get_many_into(["v1/o/x"], [memoryview(np.zeros(4 * 4096, np.uint8))], lambda i, n: None)
    time.sleep(0.2)  # any range still running has finished
    assert opens == ["v1/o/x"]
    tier.close()


def test_objects_round_trip_bit_exact(tier_uri: str) -> None:
    tier = open_tier(tier_uri)
    blobs = {"v1/a/empty": b"", "v1/a/small": os.urandom(1000), "v1/b/big": os.urandom((17 << 20) + 12345)}  # 3 ranged reads, the last partial
    tier.put_many(list(blobs.items()))
    # 1,000 bytes read back as 1,051 when the upload's checksum trailers are stored as data
    assert tier.get_many(list(blobs)) == list(blobs.values())
    assert tier.get("v1/a/missing") is None and tier.contains_many(["v1/a/small", "v1/nope"]) == [True, False]
    listed = tier.list("v1/a")
    assert [(o.key, o.size) for o in listed] == [("v1/a/empty", 0), ("v1/a/small", 1000)]
    assert abs(listed[0].mtime - time.time()) < 120
    tier.put("v1/a/small", b"replaced")
    assert tier.get("v1/a/small") == b"replaced"
    assert tier.delete("v1/a/small") and not tier.delete("v1/a/small")
    assert tier.delete_many(["v1/a/empty", "v1/b/gone"]) == 1
    assert [f.key for f in tier.folders("v1")] == ["v1/a", "v1/b"]
    tier.put("v1/b/sub/more", b"1")
    tier.delete_prefix("v1/b")
    tier.delete_prefix("v1/none")
    assert tier.list("v1") == [] and [f.key for f in tier.folders("v1")] == ["v1/a"]
    tier.close()


@pytest.mark.s3
def test_the_s3_tier_stores_exact_bytes_where_the_environment_says_nothing(s3_module) -> None:
    """Without AWS_REQUEST_CHECKSUM_CALCULATION=WHEN_REQUIRED, pyarrow's uploads to SeaweedFS keep
    the chunked-encoding trailers as data (1,000 bytes read back as 1,051): the tier sets it."""
    code = ("import sys; from ctxcache.store.tiers import open_tier; t = open_tier(sys.argv[1]); "
            "t.put('v1/exact', b'a' * 1000); print(len(t.get('v1/exact')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    out = subprocess.run([sys.executable, "-c", code, s3_module.uri(prefix="env")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1000"]


def test_the_s3_tier_skips_the_sdks_response_hashing_unless_the_environment_says() -> None:
    """The SDK's default hashes every GET's body (0.51 s of CPU per GB read vs 0.30, loads check
    xxh3 regardless): the tier asks for validation only where required, an operator's setting stays."""
    code = ("import os, sys; from ctxcache.store.tiers import open_tier; open_tier(sys.argv[1]); "
            "print(os.environ.get('AWS_RESPONSE_CHECKSUM_VALIDATION'))")
    uri = f"s3://b/p?endpoint_override=127.0.0.1:{free_port()}&scheme=http&anonymous=true"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for given, want in ((None, "WHEN_REQUIRED"), ("WHEN_SUPPORTED", "WHEN_SUPPORTED")):
        out = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, timeout=60,
                             env=env if given is None else {**env, "AWS_RESPONSE_CHECKSUM_VALIDATION": given})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [want]


def test_an_unreachable_s3_endpoint_is_unavailable_at_once() -> None:
    tier = open_tier(f"s3://b/p?endpoint_override=127.0.0.1:{free_port()}&scheme=http&anonymous=true")
    for op in (lambda: tier.get("v1/x"), lambda: tier.put("v1/x", b"1"), lambda: tier.list("v1"),
               lambda: tier.get_many(["v1/x", "v1/y"])):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="object store s3://b/p"):
            op()
        assert time.monotonic() - t0 < 5


def test_a_batch_past_its_deadline_is_unavailable(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}", TierConfig(threads=1, deadline_s=0.2))
    tier.get = lambda key: time.sleep(1)  # type: ignore[method-assign]  # a hung server
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="did not finish within 0.2 s"):
        tier.get_many(["v1/a", "v1/b"])
    assert time.monotonic() - t0 < 0.9


def test_a_dead_writers_temp_file_is_never_listed_and_swept_when_old(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}")
    tier.put("v1/c/whole", b"abc")
    partial = tmp_path / "v1" / "c" / f"torn{TEMP_MARK}0a1b"
    partial.write_bytes(b"ab")  # what a writer killed before its rename leaves
    assert [o.key for o in tier.list("v1")] == ["v1/c/whole"]
    assert tier.sweep_partials("v1", older_than=time.time() - 60) == 0  # young: may be live
    assert tier.sweep_partials("v1", older_than=time.time() + 1) == 1
    assert not partial.exists() and tier.get("v1/c/whole") == b"abc"
