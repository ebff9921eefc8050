"""What a GPU runner's admission needs beside the runner: the question's prefill attention (and
its chunks), and the head a resident context's next stream starts from."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.decoder.gpu.tables import GpuDenseTables
from ctxcache.kernels.split_k_attention import region
from ctxcache.methods.budget import Budget
from ctxcache.models.attention import appended_attention
from ctxcache.models.packed_attention import packed_appended_attention, packs

# prompt tokens x layers an eager prefill chunk may carry beside one decode step: a 20-token
# question over 32 layers goes in two chunks. Each chunk lands on one step of the others, each
# chunk after the first costs the joiner a step (H100, 32K x 7 decoding, one chunk: joiner TTFT
# p50 42 / 55 ms sparse / dense, but the others' ITL p99 2.05x their median in sparse mode)
PREFILL_TOKEN_LAYERS = 512
# a replayed prefill's chunk takes at most this share of a decode step's device time (both
# measured), in as few even chunks as that allows: each chunk after the first costs the joiner a
# step. H100, 32K x 7 decoding, through gRPC: the sparse prefill (14.4 ms: it also seeds follow)
# goes in 2 chunks beside 13 ms steps, the joiner's TTFT 37-51 ms (by its arrival's phase), the
# others' ITL p99 1.57-1.61x their median; dense (9.9 ms) in one beside 19 ms steps, 31-37 ms,
# 1.59x (three runs). At 0.7 the sparse prefill (21 ms then) took 3 chunks and the joiner 61 ms
PREFILL_SHARE = 0.85


# a prompt is padded to a multiple of this many tokens: one prefill graph then replays every
# question of 17..32 tokens on a resident context, where a graph per exact length was captured
# only on that length's second use (H100, 32K x 7 decoding: each eager chunk cost ~20 ms of host
# time for ~6 ms of GPU time, and every joiner ran eagerly)
PAD_TO = 16

# the question's attention by models/packed_attention.py (each KV head's keys read once) where
# it packs, else SDPA: per layer at Llama-3.1-8B's shapes on an H100 (bench prefill) 85 vs 125 us
# at 32K, 247 vs 438 us at 128K
PACKED_ATTENTION = True


def padded_length(tokens: int, room: int) -> int:
    """A prompt's length padded to a multiple of PAD_TO, or its own where `room` (the most the
    slot and its index overlay take) is smaller."""
    padded = -(-tokens // PAD_TO) * PAD_TO
    return padded if padded <= room else tokens


def prompt_input(prompt: list[int], padded: int, device: torch.device) -> torch.Tensor:
    """A prefill's one input on the device, int64 [1, padded + 1]: the prompt, its padding
    (token 0), then its real length. Pinned and non-blocking: a pageable copy would wait for the
    decode step in flight."""
    host = torch.tensor([prompt + [0] * (padded - len(prompt)) + [len(prompt)]],
                        pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def layers_per_chunk(tokens: int, n_layers: int, token_layers: int) -> int:
    """Layers per prefill chunk: as even as chunks of at most `token_layers` allow."""
    chunks = -(-tokens * n_layers // token_layers)
    return -(-n_layers // chunks)


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


@dataclass(frozen=True)
class SeedPadding:
    """A padded prompt's seed inputs on the device, once per prompt: the region's bounds (lo,
    hi, follow count; int32 [3]) over its real keys, how many keys are real (int32 [1]: the
    context's and the prompt's real tokens), and which of the prompt's slots pad it."""

    bounds: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor | None  # bool [padded prompt length]: True where a slot is padding; None: none does
    complete: bool = False  # known on the host: the region holds `follow` keys, the Top-K writes every entry

    @classmethod
    def of(cls, n_ctx: int, real: torch.Tensor, padded_len: int, budget: Budget, follow: int) -> "SeedPadding":
        """real: the prompt's real tokens (int32 [1], device)."""
        keys = (real + n_ctx).to(torch.int32)
        lo, hi = region(keys, budget.sinks, budget.recent)
        return cls(torch.cat([lo, hi, (hi - lo).clamp(max=follow)]).to(torch.int32), keys,
                   torch.arange(padded_len, device=real.device) >= real)

    @classmethod
    def unpadded(cls, n: int, budget: Budget, follow: int, device: torch.device) -> "SeedPadding":
        """n keys, all real (a prompt run eagerly): seed_follow's inputs with no padding, made
        once per prompt in one copy where seed_follow would fill them for every layer."""
        lo, hi = budget.region(n)
        host = torch.tensor([lo, hi, min(follow, hi - lo), n], dtype=torch.int32, pin_memory=device.type == "cuda")
        dev = host.to(device, non_blocking=True)
        return cls(dev[:3], dev[3:], None, hi - lo >= follow)


class PrefillAttention:
    """Dense attention for a slot's prompt prefill that also indexes the new keys (sparse). The
    row's length is known on the host (the context's, plus the prompt tokens each layer has
    seen), so attention spans exactly the keys written, with no device read of the positions.
    With CSAttention's follow, the prompt's last query seeds each sparse layer's follow state
    (GpuDenseTables.seed_follow, under `budget`).

    The prompt is padded to a graph's length (slot_prefill.PAD_TO; its last slots pad it, after
    every real token: causal attention keeps them out of the real tokens' outputs); only the
    first `real` (int32 [1], device) of its keys are indexed and seeded from."""

    def __init__(self, tables: list[GpuDenseTables] | None, row: int, n_ctx: int, perm: torch.Tensor | None,
                 layers: int, real: torch.Tensor, budget: Budget | None = None,
                 dense_layers: tuple[int, ...] = (), side: torch.cuda.Stream | None = None) -> None:
        self.tables, self.row, self.n_ctx, self.perm = tables, row, n_ctx, perm
        self.budget, self.dense_layers, self.real = budget, dense_layers, real
        self.last = (real - 1).long()  # the last real token (its query seeds; its logits are the prompt's)
        self._done = [0] * layers  # prompt tokens each layer has attended so far
        self._padding: SeedPadding | None = None  # made by the first seeded layer
        # the seed feeds only the first decode step, so it runs on `side` beside the layer's
        # attention, projection and MLP, joined when the layer ends (after_layer: a layer's graph
        # ends joined); what it reads stays referenced until then
        self.side = side
        self._beside: tuple[torch.Tensor, ...] = ()

    def __call__(self, layer: int, q: torch.Tensor, cache, pos: torch.Tensor) -> torch.Tensor:
        t, col = q.shape[2], self._done[layer]
        self._done[layer] += t
        first = self.n_ctx + col
        if self.tables is not None:
            self.tables[layer].insert_span(self.row, cache.k[layer][0, :, first:first + t], col, self.perm, self.real)
            if self.budget is not None and layer not in self.dense_layers:
                self._seed(layer, q, cache.k[layer][0, :, :first + t])
        k, v = cache.k[layer][:, :, :first + t], cache.v[layer][:, :, :first + t]
        if PACKED_ATTENTION and packs(q, k):
            return packed_appended_attention(q, k.to(q.dtype), v.to(q.dtype))
        return appended_attention(q, k, v)

    def _seed(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        table = self.tables[layer]
        if self._padding is None and table.follow_prev is not None:
            self._padding = SeedPadding.of(self.n_ctx, self.real, q.shape[2], self.budget, table.follow_prev.shape[-1])
        last_q = q[0].index_select(1, self.last)[:, 0]
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())
            self._beside = (last_q, keys)
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            table.seed_follow(self.row, last_q, keys, self.budget, self._padding)

    def after_layer(self, layer: int) -> None:
        """A layer ended (LayeredPrefill): its seed, if it ran beside, joins the prefill's stream."""
        if self._beside:
            torch.cuda.current_stream().wait_stream(self.side)
            self._beside = ()
