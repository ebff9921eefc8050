"""The page-locked host pool's range bookkeeping, and loads landing in it (GPU)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from ctxcache import host_pool
from ctxcache.host_pool import ALIGN, Ranges
from ctxcache.store.arena import Arena


def test_ranges_first_fit_merge_and_exhaustion() -> None:
    r = Ranges(10 * ALIGN)
    a = r.take(3 * ALIGN)
    b = r.take(1)  # rounded up to a page
    c = r.take(6 * ALIGN)
    assert (a, b, c) == (0, 3 * ALIGN, 4 * ALIGN) and r.used == 10 * ALIGN
    assert r.take(1) is None  # full
    r.give(b, 1)
    assert r.take(2 * ALIGN) is None  # one page free, not two
    r.give(a, 3 * ALIGN)  # merges with b's page: 4 pages from 0
    assert r.largest_free() == 4 * ALIGN
    r.give(c, 6 * ALIGN)
    assert r.largest_free() == 10 * ALIGN and r.used == 0


def test_ranges_random_alloc_free_never_overlap_and_coalesce_fully() -> None:
    rng = random.Random(7)
    r = Ranges(256 * ALIGN)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            r.give(off, live.pop(off))
        else:
            size = rng.randint(1, 20) * ALIGN - rng.randint(0, ALIGN - 1)
            off = r.take(size)
            if off is not None:
                live[off] = size
        spans = sorted((o, o + -(-s // ALIGN) * ALIGN) for o, s in live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))  # no two live ranges overlap
        assert all(e <= r.capacity for _, e in spans)
    for off, size in list(live.items()):
        r.give(off, size)
    assert r.used == 0 and r.largest_free() == r.capacity


@pytest.mark.gpu
def test_pinned_arenas_come_from_the_pool_and_go_back_when_their_tensors_die() -> None:
    pool = host_pool.install(64 << 20)
    try:
        assert pool is not None
        specs = [(torch.int8, (1000, 1000)), (torch.float16, (3, 7))]
        arena = Arena(specs, huge_pages=False, pinned=True)
        assert arena.pooled and pool.used >= 1_000_000
        t = arena.tensors[0]
        assert t.is_pinned()
        t.fill_(3)
        on_gpu = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(on_gpu.sum()) == 3 * t.numel()
        big = Arena([(torch.uint8, (80 << 20,))], huge_pages=False, pinned=True)
        assert not big.pooled and big.tensors[0].is_pinned()  # no room: locked on its own
        del arena, t, big
        gc.collect()
        assert pool.used == 0
    finally:
        host_pool.uninstall()


@pytest.mark.gpu
def test_a_builds_host_copies_land_in_the_pool_else_pinned_memory() -> None:
    from ctxcache.host_copy import to_host, wait_for_host_copies

    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    pool = host_pool.install(8 << 20)
    try:
        assert pool is not None
        out = to_host(src)
        wait_for_host_copies(src.device)
        assert pool.used >= src.numel() * 4 and out.is_pinned() and torch.equal(out, src.cpu())
        spill = to_host(src.repeat(2))  # 8 MB: no room left, pinned by torch instead
        wait_for_host_copies(src.device)
        assert spill.is_pinned() and torch.equal(spill[: src.numel()], src.cpu())
        del out
        gc.collect()
        assert pool.used == 0
    finally:
        host_pool.uninstall()


def test_a_pool_that_cannot_be_locked_is_one_line_and_loads_run_unpinned(monkeypatch, caplog) -> None:
    from ctxcache.service import assembly

    def refuse(buf):  # noqa: ANN001, ANN202
        raise MemoryError("cannot page-lock 6.00 GiB of host memory (cudaHostRegister: out of memory)")

    monkeypatch.setattr(host_pool, "page_lock", refuse)
    try:
        with caplog.at_level("WARNING", logger="ctxcache.host_pool"):
            assert assembly.install_host_pool(None, 2 << 30) is False  # the store then loads unpinned
        assert [r.getMessage() for r in caplog.records] == [
            "no page-locked host pool (cannot page-lock 6.00 GiB of host memory (cudaHostRegister: out of memory)): "
            "loads run unpinned, their copies to the GPU slower"]
        assert host_pool.installed() is None
        assert assembly.install_host_pool(0, 2 << 30) is True  # no pool asked for: each load locks its own
    finally:
        host_pool.uninstall()
