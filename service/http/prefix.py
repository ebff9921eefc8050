"""Automatic reuse: the cached context whose tokens are exactly those of a request's leading
messages, found without the client naming it.

A context id is content-addressed (store/ids.py: model, tokenizer, template, method and its
parameters, tenant, K/V codec and the token ids), so no index is needed: for each split of the
conversation into leading messages (the candidate context) and the turn after them, render and
tokenize the leading messages exactly as PutContext does (Prompter.context_tokens), compute
the id PutContext would give them with the server's default method, under each K/V codec, and
ask the store. Contexts built with another method or parameters are reached by reference
(`cached_content`) only. Splits whose rendering is not a prefix of the whole conversation's
(a template that renders earlier turns differently once more follow) are skipped: their cached
tokens would not be a true prefix of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxcache.artifact import KV_CODECS
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.build_queue import BuildQueue
from ctxcache.service.convert import PutSpec, method_spec
from ctxcache.service.errors import FailedPrecondition, NotFound
from ctxcache.service.prompting import Messages


@dataclass(frozen=True)
class Match:
    context_id: str
    n_messages: int  # the leading messages the context holds; the turn is what follows
    n_tokens: int


def candidate_splits(indexer: BuildQueue, messages: Messages) -> list[int]:
    """Split points k (context = messages[:k]), longest first, whose rendering is a prefix of
    the whole conversation's. Rendering is cheap (no tokenizing)."""
    full = indexer.prompter.render(messages, add_generation_prompt=True)
    return [k for k in range(len(messages) - 1, 0, -1)
            if full.startswith(indexer.prompter.render(messages[:k], add_generation_prompt=False))]


def find(indexer: BuildQueue, messages: Messages, tenant: str) -> Match:
    """The READY context of `tenant` holding the longest leading messages; NotFound if none,
    FailedPrecondition if the only match is still BUILDING."""
    s = indexer.settings
    method, params = method_spec(pb.MethodSpec(), s.method, s.method_params)
    codecs = [s.kv_codec, *(c for c in KV_CODECS if c != s.kv_codec)]
    building = None
    for k in candidate_splits(indexer, messages):
        tokens = indexer.prompter.context_tokens(messages[:k])
        if len(tokens) > indexer.max_tokens:
            continue
        for codec in codecs:
            spec = PutSpec(messages[:k], method=method, method_params=params, tenant=tenant, kv_codec=codec)
            cid = indexer.context_id(spec, tokens)
            if indexer.backend.manifest(cid) is not None:
                return Match(cid, k, len(tokens))
            job = indexer.job(cid)
            if building is None and job is not None and job.state == "building":
                building = job
    if building is not None:
        raise FailedPrecondition(f"the cached context {building.context_id} for these leading messages is still "
                                 f"BUILDING ({building.progress:.0%}); retry when it is READY")
    raise NotFound("no cached context matches the leading messages of this request: create one with "
                   "POST /v1/cached_contents from those messages, or name one in `cached_content`")
