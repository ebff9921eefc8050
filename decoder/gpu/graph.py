"""CUDA-graph-captured decode step: static token/position buffers, one replay per token.

The model's own forward reads `int(pos.max())` for a bounds check (a host sync that graphs
forbid), so the captured step calls the same modules without it; bounds are checked on the
host before each replay instead, against a host copy of the longest row: reading the device
lengths each step would be a sync that leaves the GPU idle while the host queues the next
replay (measured ~0.5 ms per step at 128K, batch 8, bench/profile_decode.py at d74d176)."""

from __future__ import annotations

import torch

from ctxcache.models.kv_cache import KVCache
from ctxcache.models.llama import AttentionFn, Transformer


def forward_step(model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                 attn: AttentionFn) -> torch.Tensor:
    """tokens, pos [B, 1] -> logits [B, V] fp32 (no host syncs). Each block's last residual add
    goes into the next norm's launch (Block.forward_pending): 32 launches less a Llama-3.1-8B step."""
    x, pending = model.model.embed_tokens(tokens), None
    for i, block in enumerate(model.model.layers):
        x, pending = block.forward_pending(x, pending, i, pos, cache, model.rope, attn)
    return model.lm_head(model.model.norm.add_forward(x, pending)[1])[:, -1].float()


def carried_state(attn: AttentionFn) -> list[torch.Tensor]:
    """The tensors an attention's step reads and rewrites for the next step (CSAttention
    follow's previous best keys): a capture's warm-up runs must leave them as they were, or
    the first replay follows keys of steps that never happened."""
    carried = getattr(attn, "carried", None)
    return list(carried()) if carried is not None else []


class GraphDecoder:
    """Greedy or logits-only decode of a batch whose cache rows may differ in length."""

    def __init__(self, model: Transformer, cache: KVCache, attn: AttentionFn, use_graph: bool = True,
                 label: str = "") -> None:
        self.model, self.cache, self.attn = model, cache, attn
        self.label = label  # what its steps' device times are kept under, after the bucket (" lean")
        dev = cache.lengths.device
        self.tokens = torch.zeros(cache.batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(cache.batch, 1, dtype=torch.long, device=dev)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph = use_graph and dev.type == "cuda"
        self._longest: int | None = None  # host copy of max(cache.lengths); None: read it at the next step

    def lengths_changed(self) -> None:
        """Call after changing cache.lengths other than through step() (one sync at the next step)."""
        self._longest = None

    @torch.inference_mode()
    def _run(self) -> None:
        self.logits = forward_step(self.model, self.tokens, self.pos, self.cache, self.attn)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture at the current lengths. The warm-up runs' cache writes are overwritten by the
        step that follows; what a step carries to the next (carried_state) is put back."""
        self.pos.copy_(self.cache.lengths[:, None])
        kept = [(t, t.clone()) for t in carried_state(self.attn)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(s)
        for t, before in kept:  # outside the capture: a copy inside would be replayed every step
            t.copy_(before)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._run()

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] at each row's current length -> logits [B, V]; lengths are left to the
        caller (a runner advances only the rows it stepped). No bounds check."""
        self.tokens.copy_(tokens[:, None])
        self.pos.copy_(self.cache.lengths[:, None])
        if self.use_graph:
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            self._run()
        return self.logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] -> logits [B, V]; advances every row by one position."""
        if self._longest is None:
            self._longest = int(self.cache.lengths.max())
        if self._longest >= self.cache.max_len:
            raise ValueError(f"cache full at {self.cache.max_len} tokens")
        logits = self.run(tokens)
        self.cache.lengths += 1
        self._longest += 1
        return logits

    def greedy(self, first_logits: torch.Tensor, steps: int) -> torch.Tensor:
        """-> tokens [B, steps]: argmax of first_logits, then of each step's logits."""
        out = [first_logits.argmax(-1)]
        for _ in range(steps - 1):
            out.append(self.step(out[-1]).argmax(-1))
        return torch.stack(out, dim=1)
