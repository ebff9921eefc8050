"""Capturing (a prefill graph recorded a layer group at a time as its admission runs) with the
CUDA graph calls replaced by fakes, so its bookkeeping runs on the CPU: each group is recorded
then replayed, the key replays once every layer ran, and a capture that fails mid-prefill
restarts the prefill eagerly from its first layer."""

import torch

from ctxcache.decoder.gpu.prefill_graph import Capturing, PrefillGraphs, Replay

LAYERS = 6


class _Prefill:
    """A LayeredPrefill's surface: run(n) advances `layer`, logits after the last."""

    def __init__(self, ids: torch.Tensor, log: list) -> None:
        self.layer, self.log, self.ids = 0, log, ids

    def run(self, layers: int) -> torch.Tensor | None:
        end = min(self.layer + layers, LAYERS)
        self.log += [("eager", i) for i in range(self.layer, end)]
        self.layer = end
        return self.ids.float() * 2 if end == LAYERS else None


class _Graph:
    def __init__(self, layer: int, log: list) -> None:
        self.layer, self.log = layer, log

    def replay(self) -> None:
        self.log.append(("replay", self.layer))


def _graphs(log: list, fail_at: int | None = None) -> PrefillGraphs:
    """PrefillGraphs whose record() appends fake graphs (as many layers as asked), failing
    (False, broken) once it would record layer `fail_at`."""
    graphs = PrefillGraphs()

    def record(key, cap, layers, make):
        if cap.run is None:
            cap.run = make(cap.ids)
        start = len(cap.graphs)
        if fail_at is not None and start <= fail_at < start + layers:
            graphs.broken = True
            return False
        cap.graphs += [_Graph(i, log) for i in range(start, start + layers)]
        cap.run.layer = start + layers
        cap.logits = cap.ids.float() * 2 if start + layers == LAYERS else None
        return True
    graphs.record = record
    return graphs


def test_groups_are_recorded_then_replayed_and_the_key_replays_after():
    log = []
    graphs = _graphs(log)
    ids = torch.tensor([[4, 5, 6]])
    run = Capturing(graphs, (0, 100, 16), ids, LAYERS, lambda i: _Prefill(i, log))
    got = [run.run(2), run.run(3), run.run(2)]
    assert got[0] is None and got[1] is None and torch.equal(got[2], ids.float() * 2)
    assert log == [("replay", i) for i in range(LAYERS)] and run.layer == LAYERS
    assert graphs._seen[(0, 100, 16)] is run.cap  # the key's next prompts replay these graphs
    log.clear()
    assert torch.equal(Replay(run.cap, ids).run(LAYERS), ids.float() * 2)
    assert log == [("replay", i) for i in range(LAYERS)]


def test_a_failed_capture_restarts_the_prefill_eagerly_from_its_first_layer():
    log = []
    graphs = _graphs(log, fail_at=3)
    ids = torch.tensor([[7, 8]])
    run = Capturing(graphs, (1, 50, 16), ids, LAYERS, lambda i: _Prefill(i, log))
    assert run.run(2) is None and run.run(2) is None  # layers 0-1 replayed; 2-3 fail: eager 0-1
    assert run.layer == 2
    out = run.run(LAYERS)
    assert torch.equal(out, ids.float() * 2)
    assert log == [("replay", 0), ("replay", 1)] + [("eager", i) for i in range(LAYERS)]
    assert (1, 50, 16) not in graphs._seen  # a half-captured key is never replayed
