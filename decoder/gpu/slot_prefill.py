"""What a GPU runner's admission needs beside the runner: the question's prefill attention (and
its chunks), and the head a resident context's next stream starts from."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.decoder.gpu.selector import GpuDenseTables
from ctxcache.generation import LayeredPrefill
from ctxcache.methods.budget import Budget
from ctxcache.models.attention import appended_attention

# prompt tokens x layers a prefill chunk may carry beside one decode step: a 20-token question
# over 32 layers goes in two chunks. Each chunk lands on one step of the others, each chunk after
# the first costs the joiner a step (H100, 32K x 7 decoding, one chunk: joiner TTFT p50 42 / 55
# ms sparse / dense, but the others' ITL p99 2.05x their median in sparse mode, over the 2x bar)
PREFILL_TOKEN_LAYERS = 512


def layers_per_chunk(tokens: int, n_layers: int, token_layers: int) -> int:
    """Layers per prefill chunk: as even as chunks of at most `token_layers` allow."""
    chunks = -(-tokens * n_layers // token_layers)
    return -(-n_layers // chunks)


def eager_chunks(prefill: LayeredPrefill, per_chunk: int) -> Iterator[torch.Tensor | None]:
    while (logits := prefill.run(per_chunk)) is None:
        yield None
    yield logits


@dataclass
class ResidentHead(ContextArtifact):
    """What a Generate on a context resident in a slot needs of its artifact, without its K/V
    or tables (kept by the runner, so the stream skips the DRAM tier and never reloads the
    artifact from disk for a context already in HBM): tokens, last logits, the method, and
    layer 0's table names (what `serves_index` checks)."""

    @classmethod
    def of(cls, art: ContextArtifact) -> "ResidentHead":
        shell = LayerArtifact(torch.empty(0), torch.empty(0), tables=dict(art.layers[0].tables))
        return cls(**{f.name: getattr(art, f.name) for f in fields(art)} | {"layers": [shell]})


class PrefillAttention:
    """Dense attention for a slot's prompt prefill that also indexes the new keys (sparse). The
    row's length is known on the host (the context's, plus the prompt tokens each layer has
    seen), so attention spans exactly the keys written, with no device read of the positions.
    With CSAttention's follow, the prompt's last query seeds each sparse layer's follow state
    (GpuDenseTables.seed_follow, under `budget`)."""

    def __init__(self, tables: list[GpuDenseTables] | None, row: int, n_ctx: int, perm: torch.Tensor | None,
                 layers: int, budget: Budget | None = None, dense_layers: tuple[int, ...] = ()) -> None:
        self.tables, self.row, self.n_ctx, self.perm = tables, row, n_ctx, perm
        self.budget, self.dense_layers = budget, dense_layers
        self._done = [0] * layers  # prompt tokens each layer has attended so far

    def __call__(self, layer: int, q: torch.Tensor, cache, pos: torch.Tensor) -> torch.Tensor:
        t, col = q.shape[2], self._done[layer]
        self._done[layer] += t
        first = self.n_ctx + col
        if self.tables is not None:
            self.tables[layer].insert_span(self.row, cache.k[layer][0, :, first:first + t], col, self.perm)
            if self.budget is not None and layer not in self.dense_layers:
                self.tables[layer].seed_follow(self.row, q[0, :, -1], cache.k[layer][0, :, :first + t], self.budget)
        return appended_attention(q, cache.k[layer][:, :, :first + t], cache.v[layer][:, :, :first + t])
