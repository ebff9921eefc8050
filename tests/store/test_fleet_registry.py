"""The fleet's Redis parts against a real redis-server: one build per id, jobs taken over from
a dead indexer, deletes that stop a build and reach every listener, hot sets that expire."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from ctxcache.store.registries.fleet_registry import Enqueued, FleetRegistry, FleetState
from ctxcache.store.registries.job_stream import JobStream

pytestmark = pytest.mark.redis
CID = "a" * 64


@pytest.fixture
def fleet(redis_server):
    reg = FleetRegistry(redis_server.config())
    yield reg
    reg.close()


def _stream(redis_server, name: str, lease_s: float = 0.3) -> JobStream:
    return JobStream(redis_server.config(), name, lease_s, block_s=0.1)


def test_one_build_per_id_then_ready(fleet, redis_server):
    out, job = fleet.enqueue(CID, [5, 6, 7], "{}", "t1", claim_s=30)
    assert out == Enqueued.QUEUED and job
    assert fleet.enqueue(CID, [5, 6, 7], "{}", "t1", claim_s=30) == (Enqueued.BUILDING, "")
    taken = _stream(redis_server, "ix1").take()
    assert (taken.context_id, taken.job_id, taken.tokens, taken.deliveries) == (CID, job, [5, 6, 7], 1)
    assert fleet.start(CID, job, "ix1", 30) == 1
    assert fleet.progress(CID, job, 0.5, 30)
    assert fleet.facts(CID).progress == 0.5 and fleet.facts(CID).indexer == "ix1"
    assert fleet.finish(CID, job, "s3://b/v1/x")
    f = fleet.facts(CID)
    assert (f.state, f.uri, f.tenant, f.n_tokens) == (FleetState.READY, "s3://b/v1/x", "t1", 3)
    assert _stream(redis_server, "ix1").take() is None  # no second job was queued
    # a caller that finds no artifact (lost from the object store) builds again: READY was stale
    out, again = fleet.enqueue(CID, [5, 6, 7], "{}", "t1", claim_s=30)
    assert out == Enqueued.QUEUED and again != job and fleet.facts(CID).state == FleetState.BUILDING


def test_a_dead_indexers_job_is_taken_over_after_its_lease(fleet, redis_server):
    _, job = fleet.enqueue(CID, [1], "{}", "", claim_s=30)
    a, b = _stream(redis_server, "ix-a"), _stream(redis_server, "ix-b")
    first = a.take()
    assert first is not None and b.take() is None  # taken, and a is alive within its lease
    assert a.keep_alive(first.entry_id)
    time.sleep(0.2)
    assert a.keep_alive(first.entry_id)  # a's heartbeat keeps it past the lease
    time.sleep(0.2)
    assert b.take() is None
    time.sleep(0.4)  # a stops beating: b takes the job over
    again = b.take()
    assert again is not None and again.entry_id == first.entry_id and again.deliveries == 2
    assert not a.keep_alive(first.entry_id)  # a, if it was only slow, learns it lost the job
    assert fleet.start(CID, job, "ix-b", 30) == 1
    b.ack(again.entry_id)
    assert b.pending() == 0 and b.waiting() == 0


def test_a_job_handed_back_is_taken_at_once_not_after_the_lease(fleet, redis_server):
    fleet.enqueue(CID, [1], "{}", "", claim_s=30)
    a, b = _stream(redis_server, "ix-a", lease_s=30), _stream(redis_server, "ix-b", lease_s=30)
    first = a.take()
    assert b.take() is None
    a.release(first.entry_id)  # a drains
    again = b.take()
    assert again is not None and again.entry_id == first.entry_id


def test_delete_stops_the_build_and_a_new_put_supersedes_it(fleet):
    _, old = fleet.enqueue(CID, [1], "{}", "", claim_s=30)
    assert fleet.start(CID, old, "ix", 30) == 1
    assert fleet.delete(CID) == FleetState.BUILDING
    assert not fleet.progress(CID, old, 0.3, 30)  # the indexer cancels
    assert not fleet.finish(CID, old, "file:///x")  # and never resurrects it
    assert fleet.facts(CID).state == FleetState.DELETED
    out, new = fleet.enqueue(CID, [1], "{}", "", claim_s=30)  # the claim went with the delete
    assert out == Enqueued.QUEUED and new != old
    assert not fleet.progress(CID, old, 0.4, 30) and fleet.progress(CID, new, 0.4, 30)
    assert fleet.start(CID, old, "ix", 30) == 0  # a stale entry of the old job is skipped


def test_deletes_reach_every_listener_within_a_second(fleet, redis_server):
    got: list[tuple[str, float]] = []
    seen = threading.Event()
    other = FleetRegistry(redis_server.config())
    try:
        other.listen(lambda cid: (got.append((cid, time.monotonic())), seen.set()))
        time.sleep(0.3)  # subscribed
        t0 = time.monotonic()
        fleet.delete(CID)
        assert seen.wait(1.0) and got[0][0] == CID and got[0][1] - t0 < 1.0
    finally:
        other.close()


def test_hot_membership_expires_with_the_heartbeat(fleet):
    fleet.heartbeat("127.0.0.1:7001", 0.3, add={CID})
    fleet.heartbeat("127.0.0.1:7002", 5.0, add={CID})
    assert fleet.hot_workers(CID) == ["127.0.0.1:7001", "127.0.0.1:7002"]
    fleet.heartbeat("127.0.0.1:7002", 5.0, remove={CID})
    assert fleet.hot_workers(CID) == ["127.0.0.1:7001"]
    time.sleep(0.4)
    assert fleet.hot_workers(CID) == []


def test_reconcile_records_keep_tombstones_and_live_builds(fleet):
    assert fleet.record_ready(CID, "s3://b/x", "t", 9) == "ADDED"
    assert fleet.record_ready(CID, "s3://b/x", "t", 9) == "KEPT"
    fleet.delete(CID)
    assert fleet.record_ready(CID, "s3://b/x", "t", 9) == "DELETED"
    other = "b" * 64
    fleet.enqueue(other, [1], "{}", "", 30)
    assert fleet.record_ready(other, "s3://b/y", "", 1) == "KEPT"
    assert {f.context_id: f.state for f in fleet.entries()} == {CID: FleetState.DELETED,
                                                                other: FleetState.BUILDING}


def test_a_build_is_lost_only_without_its_claim_and_under_its_own_job(fleet, redis_server):
    _, job = fleet.enqueue(CID, [1, 2], "{}", "", claim_s=0.2)
    assert fleet.queued_jobs() == {job}  # the ids alone, not the entries' packed tokens
    building = fleet.facts(CID)
    assert not fleet.fail_lost(building, "lost")  # its claim is held: someone builds or will
    time.sleep(0.3)  # the claim lapses
    assert not fleet.fail_lost(replace(building, job_id="another job"), "lost")
    assert fleet.fail_lost(building, "lost")
    f = fleet.facts(CID)
    assert (f.state, f.error) == (FleetState.FAILED, "lost")
    assert fleet.enqueue(CID, [1, 2], "{}", "", claim_s=30)[0] == Enqueued.QUEUED  # a new Put builds it


def test_a_ready_entry_is_dropped_only_as_it_was_read(fleet):
    fleet.record_ready(CID, "s3://b/x", "t", 9)
    seen = fleet.facts(CID)
    assert not fleet.drop_ready(replace(seen, updated_at=seen.updated_at - 1))  # changed since: kept
    assert fleet.drop_ready(seen) and fleet.facts(CID) is None


def test_a_periodic_task_is_due_once_per_interval_across_workers(fleet, redis_server):
    other = FleetRegistry(redis_server.config())
    assert fleet.due("gc", 0.3)
    assert not other.due("gc", 0.3) and not fleet.due("gc", 0.3)
    time.sleep(0.35)
    assert other.due("gc", 0.3) and not fleet.due("gc", 0.3)
    other.close()


def test_a_one_at_a_time_task_has_one_leader(fleet, redis_server):
    other = FleetRegistry(redis_server.config())
    assert fleet.lead("reconcile", "w1", 30) and not other.lead("reconcile", "w2", 30)
    other.step_down("reconcile", "w2")  # not its lock: held still
    assert not other.lead("reconcile", "w2", 30)
    fleet.step_down("reconcile", "w1")
    assert other.lead("reconcile", "w2", 30)
    other.close()


def test_the_fleet_registry_and_job_stream_import_no_torch():
    code = ("import sys, ctxcache.store.registries.fleet_registry, ctxcache.store.registries.job_stream; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_damaged_is_kept_by_reconcile_and_left_by_a_new_build_or_a_delete(fleet):
    assert fleet.mark_damaged(CID, "chunk k0: checksum mismatch", tenant="t")  # no entry (Redis came back empty)
    f = fleet.facts(CID)
    assert (f.state, f.error, f.tenant) == (FleetState.DAMAGED, "chunk k0: checksum mismatch", "t")
    assert fleet.record_ready(CID, "s3://b/x", "t", 9) == "DAMAGED"  # reconcile does not call it READY
    assert [d.context_id for d in fleet.damaged()] == [CID]
    out, job = fleet.enqueue(CID, [1], "{}", "t", 30)  # a Put of its content builds it again
    assert out == Enqueued.QUEUED and fleet.facts(CID).state == FleetState.BUILDING
    assert not fleet.mark_damaged(CID, "late news of the old write")  # the build replaces it
    assert fleet.damaged() == []
    assert fleet.finish(CID, job, "s3://b/x") and fleet.mark_damaged(CID, "again")
    fleet.delete(CID)
    assert not fleet.mark_damaged(CID, "after the delete") and fleet.damaged() == []
