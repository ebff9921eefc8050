"""bench step_profile --admit: the copies' and kernels' busy time and their overlap from device
events (unions of intervals, so concurrent copies or kernels are not counted twice)."""

from types import SimpleNamespace

from ctxcache.bench.common.admit_profile import busy, device_activity, merged, overlap


def test_intervals_merge_and_overlap():
    assert merged([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    assert busy([(0, 2), (1, 3), (10, 11)]) == 4
    assert overlap([(0, 4), (6, 10)], [(3, 7), (9, 12)]) == 1 + 1 + 1  # 3-4, 6-7, 9-10
    assert overlap([(0, 1)], [(1, 2)]) == 0 and overlap([], [(0, 1)]) == 0


def _event(name, start_ms, end_ms, stream, device="CUDA"):
    return SimpleNamespace(name=lambda: name, start_ns=lambda: start_ms * 1e6, end_ns=lambda: end_ms * 1e6,
                           device_resource_id=lambda: stream, device_type=lambda: SimpleNamespace(name=device))


def test_device_activity_splits_copies_from_kernels():
    """Two layers' copies on stream 20, each beside the previous layer's kernels on stream 7;
    device-to-device copies, memsets and CPU events count as neither."""
    events = [_event("Memcpy HtoD (Pinned -> Device)", 0, 2, 20), _event("Memcpy HtoD (Pinned -> Device)", 2, 4, 20),
              _event("sdpa_kernel", 2, 3, 7), _event("gemm", 2.5, 3.5, 7), _event("sdpa_kernel", 4, 5, 7),
              _event("Memcpy DtoD (Device -> Device)", 4, 6, 7), _event("Memset (Device)", 5, 6, 7),
              _event("aten::copy_", 0, 9, 0, device="CPU")]
    got = device_activity(events)
    assert got == {"h2d_busy_ms": 4, "kernels_busy_ms": 2.5, "overlap_ms": 1.5, "device_span_ms": 6,
                   "copy_streams": [20], "kernel_streams": [7]}
