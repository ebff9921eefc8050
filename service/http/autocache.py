"""Automatic caching, as OpenAI caches prompts: a chat with no cached context (a miss) has its
longest leading messages of at least `--auto-cache-min-tokens` tokens submitted as a context of
the caller's tenant (the server's default method and codec, so that the next request with those
messages finds it: prefix.py computes the same id), with a TTL; the store's LRU bounds them as
any other. The miss waits for that build and is then decoded over the context (from the built
artifact, while the store write goes on: early.py), the rest of the prompt prefilled, exactly as every later request with that prefix (a hit) is: the same coded K/V,
the same selection, the same tokens, so caching never changes an answer (OpenAI's promise). A
concurrent miss with the same prefix joins the build. Raw-text completions have no messages:
their prefix is cut at a token block (raw_prefix.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.indexer.job_spec import PutSpec
from ctxcache.errors import ServiceError
from ctxcache.service.http.prefix import PrefixLookup
from ctxcache.prompting import Messages

log = logging.getLogger("ctxcache.service.http")
TTL_S = 3600.0  # an automatic context lives an hour after its build (OpenAI keeps them up to one)


@dataclass(frozen=True)
class Registered:
    """A miss's prefix submitted as a context: the prompt's first `split` messages (a chat) or
    tokens (a completion), `n_tokens` tokens; job: its build (BuildQueue's or a fleet's Job),
    None when it was READY already."""

    context_id: str
    split: int
    n_tokens: int
    job: Any


def submit_prefix(indexer: BuildQueue, spec: PutSpec, tokens: list[int] | None,
                  what: str) -> tuple[str, Any, bool] | None:
    """indexer.submit(spec, tokens); None when it is refused (queue full, registry down) or fails:
    a registration never fails the request it serves, whose prompt is then decoded alone."""
    try:
        return indexer.submit(spec, tokens=tokens)
    except ServiceError as exc:
        log.info("automatic caching of %s skipped: %s", what, exc)
    except Exception:  # noqa: BLE001 - logged; the prompt is still answered
        log.exception("automatic caching of %s failed", what)
    return None


class AutoCache:
    def __init__(self, indexer: BuildQueue, prefixes: PrefixLookup, min_tokens: int) -> None:
        """min_tokens: 0 turns automatic registration off."""
        self.indexer, self.prefixes, self.min_tokens = indexer, prefixes, min_tokens

    def register(self, messages: Messages, tenant: str) -> Registered | None:
        """-> what was submitted (or joined, or already there); None when the prompt has no prefix
        to cache or the build queue refuses it (full, registry down: then a miss decodes alone)."""
        if not self.min_tokens:
            return None
        found = self.prefixes.longest(messages, tenant)
        if found is None or found[1] < self.min_tokens:
            return None
        p = self.prefixes
        spec = PutSpec(messages[:found[0]], ttl_s=TTL_S, method=p.method, method_params=p.params, wait=False,
                       tenant=tenant, kv_codec=self.indexer.settings.kv_codec)
        submitted = submit_prefix(self.indexer, spec, None, f"a {found[1]}-token prefix")
        if submitted is None:
            return None
        cid, job, created = submitted
        if created:
            log.info("automatic caching: %d leading messages (%d tokens) -> %s", found[0], found[1], cid[:12])
        return Registered(cid, found[0], found[1], job)
