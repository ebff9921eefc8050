"""Automatic caching, as OpenAI caches prompts: after a chat answered with no cached context (a
miss), its longest leading messages of at least `--auto-cache-min-tokens` tokens are submitted
as a context of the caller's tenant (the server's default method and codec, so that the next
request with those messages finds it: prefix.py computes the same id), with a TTL; the store's
LRU bounds them as any other. The build runs on the build queue after the answer, so it never
slows the miss it comes from; until it is READY, requests with that prefix are misses too.
Raw-text completions have no messages: their prefix is cut at a token block (raw_prefix.py).
"""

from __future__ import annotations

import logging

from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.indexer.job_spec import PutSpec
from ctxcache.errors import ServiceError
from ctxcache.service.http.prefix import PrefixLookup
from ctxcache.prompting import Messages

log = logging.getLogger("ctxcache.service.http")
TTL_S = 3600.0  # an automatic context lives an hour after its build (OpenAI keeps them up to one)


class AutoCache:
    def __init__(self, indexer: BuildQueue, prefixes: PrefixLookup, min_tokens: int) -> None:
        """min_tokens: 0 turns automatic registration off."""
        self.indexer, self.prefixes, self.min_tokens = indexer, prefixes, min_tokens

    def register(self, messages: Messages, tenant: str) -> str | None:
        """-> the id submitted (or already there), None when the prompt has no prefix to cache."""
        if not self.min_tokens:
            return None
        found = self.prefixes.longest(messages, tenant)
        if found is None or found[1] < self.min_tokens:
            return None
        p = self.prefixes
        spec = PutSpec(messages[:found[0]], ttl_s=TTL_S, method=p.method, method_params=p.params, wait=False,
                       tenant=tenant, kv_codec=self.indexer.settings.kv_codec)
        try:
            cid, _, created = self.indexer.submit(spec)
        except ServiceError as exc:  # queue full, registry down: this prompt stays a miss
            log.info("automatic caching of a %d-token prefix skipped: %s", found[1], exc)
            return None
        if created:
            log.info("automatic caching: %d leading messages (%d tokens) -> %s", found[0], found[1], cid[:12])
        return cid

    def register_quietly(self, messages: Messages, tenant: str) -> None:
        """On the pool after an answer: nothing a client waits for, so nothing may escape."""
        try:
            self.register(messages, tenant)
        except Exception:  # noqa: BLE001 - logged; the answer has been given
            log.exception("automatic caching failed")
