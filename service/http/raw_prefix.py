"""Automatic caching of raw-text completions: a `/v1/completions` prompt has no message
boundaries, so its prefix is cut at a token block instead (BLOCK tokens, OpenAI's 128-token
increments of cached prompt tokens). On a miss, the prompt's longest block-aligned prefix of
at least `--auto-cache-min-tokens` tokens, with at least one token after it (the decode needs a
token to prefill), is submitted as a context of the caller's tenant from its tokens (no chat
template: the prompt's own tokens, as the completion prefills them); the next prompt starting
with those tokens is a hit, the rest prefilled.

The id is content-addressed over the tokens (store/ids.py), so the lookup hashes each candidate
prefix and asks the store, longest first. A prompt of n tokens has n / BLOCK candidates and each
costs the store a manifest read (an object-store GET where the store reads through), so the walk
probes the longest one (the same prompt again) and then only the lengths this process has
registered or found (at most max tokens / BLOCK distinct values), at most MAX_PROBES in all: a
prefix registered by another worker is found once this worker's miss submits it (the build
queue answers "existing" and its length is learnt). As a chat's miss (autocache.py), the miss
waits for its prefix's build and is decoded over it, so its answer is a later hit's.

The context is stored with the roles of a text context (one system message), so a chat turn
that names it by reference follows it as it follows any text context.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np

from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.indexer.job_spec import PutSpec
from ctxcache.prompting import text_messages
from ctxcache.service.http.autocache import Registered, submit_prefix
from ctxcache.store import CorruptArtifact

log = logging.getLogger("ctxcache.service.http")
BLOCK = 128  # tokens: OpenAI reports cached prompt tokens in 128-token increments
MAX_PROBES = 32  # store lookups a completions miss may cost


@dataclass(frozen=True)
class RawMatch:
    context_id: str
    n_tokens: int  # the prompt's first n_tokens are the context; the rest is prefilled


class RawPrefixes:
    def __init__(self, indexer: BuildQueue, method: str, params: dict, min_tokens: int, ttl_s: float) -> None:
        """min_tokens: 0 turns automatic caching of completions off (no lookup, no registration)."""
        self.indexer, self.method, self.params = indexer, method, params
        self.min_tokens, self.ttl_s = min_tokens, ttl_s
        self._known: set[int] = set()  # prefix lengths registered or found by this process
        self._lock = threading.Lock()

    def longest(self, n: int) -> int:
        """The longest block-aligned prefix of an n-token prompt that may be cached: a token at
        least after it, within the server's context limit; 0 if it is under the minimum."""
        length = min(n - 1, self.indexer.max_tokens) // BLOCK * BLOCK
        return length if self.min_tokens and length >= max(self.min_tokens, BLOCK) else 0

    def _id(self, tokens: np.ndarray, tenant: str) -> str:
        return self.indexer.context_id(self._spec(tenant), tokens)  # type: ignore[arg-type]

    def _spec(self, tenant: str) -> PutSpec:
        return PutSpec(text_messages(""), ttl_s=self.ttl_s, method=self.method, method_params=self.params,
                       wait=False, tenant=tenant, kv_codec=self.indexer.settings.kv_codec)

    def find(self, tokens: list[int], tenant: str) -> RawMatch | None:
        """The READY context of `tenant` holding the longest block-aligned prefix of `tokens`."""
        top = self.longest(len(tokens))
        if not top:
            return None
        with self._lock:
            known = sorted((n for n in self._known if n < top), reverse=True)
        ids = np.asarray(tokens, dtype=np.int64)
        for n in [top, *known][:MAX_PROBES]:
            cid = self._id(ids[:n], tenant)
            try:
                found = self.indexer.backend.manifest(cid) is not None
            except CorruptArtifact:  # marked DAMAGED by the read: a miss, whose registration rebuilds it
                continue
            if found:
                self._learn(n)
                return RawMatch(cid, n)
        return None

    def _learn(self, n: int) -> None:
        with self._lock:
            self._known.add(n)

    def register(self, tokens: list[int], tenant: str) -> Registered | None:
        """-> what was submitted (or joined, or already there); None when the prompt has no prefix
        to cache or the build queue refuses it."""
        n = self.longest(len(tokens))
        if not n:
            return None
        submitted = submit_prefix(self.indexer, self._spec(tenant), list(tokens[:n]), f"a {n}-token completion prefix")
        if submitted is None:
            return None
        cid, job, created = submitted
        self._learn(n)
        if created:
            log.info("automatic caching: a completion's first %d tokens -> %s", n, cid[:12])
        return Registered(cid, n, n, job)
