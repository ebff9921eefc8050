"""The decode loop (gpt-fast style): prefill, decode one token, sample, stop."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ctxcache.models.kv_cache import KVCache
from ctxcache.models.llama import AttentionFn, Transformer


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if params.temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


@torch.inference_mode()
def prefill(model: Transformer, tokens: torch.Tensor, cache: KVCache, attn: AttentionFn,
            chunk: int = 1024, on_chunk=None) -> torch.Tensor:
    """Append tokens [B, T] after each row's cached length, in chunks; -> last logits [B, V]."""
    logits = None
    for s in range(0, tokens.shape[1], chunk):
        part = tokens[:, s:s + chunk]
        pos = cache.lengths[:, None] + torch.arange(part.shape[1], device=part.device)
        logits = model(part, pos, cache, attn, last_only=True)[:, -1]
        cache.lengths += part.shape[1]
        if on_chunk is not None:
            on_chunk(part.shape[1])
    return logits


class LayerMajorPrefill:
    """A prompt's prefill in `prefill`'s chunks, layer by layer: every chunk of layer l, then
    layer l + 1, the hidden states of all tokens held between layers (256 MB at 32K tokens of
    Llama-3.1-8B in bf16). Each chunk runs the same block on the same inputs at the same
    positions as in `prefill`, so K/V, captured queries and logits are bitwise the same; but
    layer l's K/V are final once `layers()` yields l, not only at the end. Why: a build hands a
    layer to the store as it is done, so its upload runs while later layers prefill (a 32K
    PutContext on the H200 uploaded 2.1 GB after a 1.8 s prefill)."""

    @torch.inference_mode()
    def __init__(self, model: Transformer, tokens: torch.Tensor, cache: KVCache, attn: AttentionFn,
                 chunk: int = 1024) -> None:
        """tokens [B, T] appended after each row's cached length, `chunk` tokens per block call."""
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
        start = cache.lengths[:, None]
        last = int(cache.lengths.max()) + tokens.shape[1] - 1  # one host read, as forward's check
        limit = min(cache.max_len, model.args.max_seq_len)
        if last >= limit:
            raise ValueError(f"position {last} exceeds the cache/model length {limit}")
        self.model, self.cache, self.attn = model, cache, attn
        self.n_tokens = tokens.shape[1]
        bounds = [(s, min(s + chunk, tokens.shape[1])) for s in range(0, tokens.shape[1], chunk)]
        # per chunk what forward computes for it: the chunk's embeddings, its positions
        self.pos = [start + torch.arange(s, e, device=tokens.device) for s, e in bounds]
        self.x = [model.model.embed_tokens(tokens[:, s:e]) for s, e in bounds]
        self.logits: torch.Tensor | None = None

    @torch.inference_mode()
    def layers(self) -> Iterator[int]:
        """Run the layers in order, yielding each once all its chunks ran (its K/V final in
        the cache); after the last, `logits` holds the last token's [B, V] (fp32)."""
        m = self.model
        for i, block in enumerate(m.model.layers):
            self.x = [block(x, i, pos, self.cache, m.rope, self.attn) for x, pos in zip(self.x, self.pos)]
            yield i
        self.logits = m.lm_head(m.model.norm(self.x[-1][:, -1:])).float()[:, -1]
        self.x = []
        self.cache.lengths += self.n_tokens


class LayeredPrefill:
    """One prompt's prefill, a group of layers at a time, at positions known on the host (no
    device read): an engine runs a group between decode steps, so a stream's admission adds a
    slice of its prefill to each of a few steps instead of stalling every decoding stream for
    all of it. A question's cost (the weights once, attention over the whole context) is per
    layer, and a question is too short to divide by tokens."""

    def __init__(self, model: Transformer, tokens: torch.Tensor, start: int, cache: KVCache,
                 attn: AttentionFn, last: torch.Tensor | None = None) -> None:
        """tokens [1, T] appended at positions start..start+T-1 of the one-row cache; `last`
        (int64 [1] on the device) is the token whose logits are wanted, the last one if None
        (a prompt padded to a graph's length ends before its padding)."""
        limit = min(cache.max_len, model.args.max_seq_len)
        if start + tokens.shape[1] > limit:
            raise ValueError(f"positions up to {start + tokens.shape[1] - 1} exceed the cache/model length {limit}")
        self.model, self.cache, self.attn = model, cache, attn
        self.pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        self.x = model.model.embed_tokens(tokens)
        self.last = last
        self.layer = 0

    def run(self, layers: int) -> torch.Tensor | None:
        """Run up to `layers` more layers: -> the last token's logits [1, V] after the last
        layer, else None."""
        m = self.model
        end = min(self.layer + max(1, layers), m.args.n_layers)
        after = getattr(self.attn, "after_layer", None)  # (work an attention left beside the layer)
        for i in range(self.layer, end):
            self.x = m.model.layers[i](self.x, i, self.pos, self.cache, m.rope, self.attn)
            if after is not None:
                after(i)
        self.layer = end
        if end < m.args.n_layers:
            return None
        x = self.x[:, -1:] if self.last is None else self.x.index_select(1, self.last)
        return m.lm_head(m.model.norm(x)).float()[:, -1]


@torch.inference_mode()
def decode_one_token(model: Transformer, token: torch.Tensor, cache: KVCache,
                     attn: AttentionFn) -> torch.Tensor:
    """token [B] -> logits [B, V]; advances every row by one position."""
    pos = cache.lengths[:, None].clone()
    logits = model(token[:, None], pos, cache, attn)[:, -1]
    cache.lengths += 1
    return logits


def decode_n_tokens(model: Transformer, first_logits: torch.Tensor, cache: KVCache,
                    attn: AttentionFn, params: SamplingParams) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (tokens [B], finished [B]) per step until every row stopped or max_tokens.

    A row stops at a stop token (which is yielded) or when its cache is full."""
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    stops = torch.tensor(params.stop_token_ids or [-1])
    finished = torch.zeros(first_logits.shape[0], dtype=torch.bool)
    logits = first_logits
    for step in range(params.max_tokens):
        tok = sample(logits, params, gen).cpu()
        finished = finished | torch.isin(tok, stops)
        full = cache.lengths.cpu() >= cache.max_len
        yield tok, finished | full
        if bool((finished | full).all()) or step == params.max_tokens - 1:
            return
        logits = decode_one_token(model, tok.to(cache.lengths.device), cache, attn)
