"""A GPU runner's warm-up before serving: every kernel compiled and every bucket's graph captured
while no stream waits, and the replayed prefill graphs checked against the eager prefill."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ctxcache.artifact import ContextArtifact

if TYPE_CHECKING:
    from ctxcache.decoder.gpu.offload_runner import OffloadRunner
    from ctxcache.decoder.gpu.runner import GpuRunner

_log = logging.getLogger(__name__)


@torch.inference_mode()
def warm_up_runner(runner: GpuRunner | OffloadRunner, arts: list[ContextArtifact]) -> None:
    """Each artifact loaded into every slot under prompts of 16 and 17 tokens (the fast runner's
    prefill graphs pad them to 16 and 32, as the offload runner's do with prefill_graphs; its
    unpadded prefill passes Triton lengths that differ by divisibility; one token is a decode
    step), then per bucket one launched and one synchronous step (the first captures its graph);
    a replayed prefill graph (the fast runner's; the offload runner's with prefill_graphs and the
    serial copy) is then checked against its eager prefill."""
    ids = [f"warm-up:{i}" for i in range(len(runner.slots))]
    arts = [art for art in arts if runner.accepts(art, runner.config, 17 + 8)]  # slots too small skip them
    # the fast runner replays captured prefills; the offload runner where they are on (offload_prompt.graphs_on)
    check = getattr(runner, "prefill_graphs", None) is not None and not getattr(runner, "pipelined_prefill", False)
    for a, art in enumerate(arts):
        rows, first = [], None
        try:
            for i, cid in enumerate(ids):
                prompt = list(range(3, 3 + (16, 17)[(a + i) % 2]))
                row, logits = runner.admit(cid, art, prompt, runner.config, 8)
                rows.append(row)
                first = logits if i == 0 else first
            for b in runner.buckets if a == 0 else ():
                runner.launch(rows[:b], [5] * b).result()
                runner.step(rows[:b], [5] * b)
            if a == 0 and check:
                _check_prefill_graph(runner, ids[0], art, rows, first)
        finally:
            for row in rows:
                runner.release(row)
            for cid in ids:
                runner.evict(cid)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def _check_prefill_graph(runner: GpuRunner | OffloadRunner, cid: str, art: ContextArtifact, rows: list,
                         eager: torch.Tensor) -> None:
    """Slot 0's prompt again (its prefill graph captured, then replayed): the logits must
    equal the eager prefill's bit for bit, else every prefill stays eager (logged). Both runners
    pad this 16-token prompt to 16: its eager run and its graphs run the same kernels."""
    prompt = list(range(3, 19))
    for _ in range(2):
        runner.release(rows[0])
        rows[0], replayed = runner.admit(cid, art, prompt, runner.config, 8)
        if not torch.equal(replayed, eager) and not runner.prefill_graphs.broken:
            runner.prefill_graphs.broken = True
            _log.warning("a replayed prefill graph's logits differ from the eager prefill's: prefills stay eager")
