"""Chat and text completions over cached contexts; knows no web framework.

A request becomes the same GenerateRequest the gRPC front receives and is validated by the same
code (convert.generate_spec), then decodes through the same GenerateStreams, in this process.
Its context is named (`cached_content`) or found from its leading messages (prefix.py); on a
miss, its long prefix is built as a context first and the answer decoded over it, as any later
hit is (autocache.py), from the build's artifact while the store write goes on (early.py). A streamed answer pulls its first event before the response starts, so a
failure before the first token (absent context, streams full) gets its real status, not a 200
with an error inside.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service import contexts, convert
from ctxcache.service.auth import Caller
from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.errors import InvalidArgument
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.decoder.stream_spec import Chunk, Final, GenerateSpec
from ctxcache.service.http.autocache import TTL_S, AutoCache, Registered
from ctxcache.service.http.early import Early, Unwritten, built
from ctxcache.service.http.prefix import PrefixLookup
from ctxcache.service.http.raw_prefix import RawPrefixes
from ctxcache.service.http.errors import error_body
from ctxcache.service.http.models import ServedModels
from ctxcache.service.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingBody
from ctxcache.service.http.shapes import Completion
from ctxcache.service.rpc.calls import in_thread, iterate_in_thread
from ctxcache.decoder.uncached import MISS

_NAME = re.compile(r"(?:cachedContents/)?([0-9a-f]{64})")
_ANY_ID = "0" * 64  # validates a request before its context is known


def context_reference(value: str) -> str:
    """`cached_content`: a context id, or its resource name cachedContents/<id>."""
    m = _NAME.fullmatch(value)
    if m is None:
        raise InvalidArgument("cached_content", f"{value[:80]!r} is not a context id (64 lowercase hex "
                              "characters) or cachedContents/<id>")
    return m[1]


def _refuse(req: SamplingBody, chat: bool) -> None:
    """What this server does not do answers 400 naming the field, never a silent default."""
    bad = {"n": req.n not in (None, 1) and "only n=1 (one choice per request) is supported",
           "logprobs": req.logprobs not in (None, False, 0) and "log probabilities are not supported",
           "presence_penalty": req.presence_penalty not in (None, 0) and "penalties are not supported",
           "frequency_penalty": req.frequency_penalty not in (None, 0) and "penalties are not supported",
           "logit_bias": bool(req.logit_bias) and "logit_bias is not supported",
           # vLLM's extras: the sampler has temperature and top_p only, so any other value is refused
           "top_k": req.top_k not in (None, 0, -1) and "top_k is not supported (top_p is)",
           "min_p": req.min_p not in (None, 0) and "min_p is not supported (top_p is)",
           "repetition_penalty": req.repetition_penalty not in (None, 1) and "penalties are not supported",
           "min_tokens": req.min_tokens not in (None, 0) and "min_tokens is not supported",
           "ignore_eos": bool(req.ignore_eos) and "ignore_eos is not supported"}
    if chat:
        assert isinstance(req, ChatCompletionRequest)
        bad |= {"tools": bool(req.tools) and "tool calling is not supported",
                "functions": bool(req.functions) and "function calling is not supported",
                "tool_choice": req.tool_choice not in (None, "none", "auto") and "tool calling is not supported",
                "top_logprobs": req.top_logprobs not in (None, 0) and "log probabilities are not supported",
                "response_format": (req.response_format or {}).get("type", "text") != "text"
                and "only the text response format is supported"}
    else:
        assert isinstance(req, CompletionRequest)
        bad |= {"echo": req.echo and "echo is not supported", "suffix": bool(req.suffix) and "suffix is not supported",
                "best_of": req.best_of not in (None, 1) and "only best_of=1 is supported"}
    for name, why in bad.items():
        if why:
            raise InvalidArgument(name, why)


def _proto(req: SamplingBody, cid: str, max_tokens: int, **turn: Any) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                 top_p=req.top_p or 0.0, max_tokens=max_tokens)
    if req.seed is not None:
        sampling.seed = req.seed
    return pb.GenerateRequest(context_id=cid, sampling=sampling, stop=req.stops(), schedule=req.schedule or "", **turn)


class Generation:
    def __init__(self, indexer: BuildQueue, decoder: GenerateStreams, pool: ThreadPoolExecutor,
                 max_tokens_limit: int, models: ServedModels, auto_cache_min_tokens: int = 0) -> None:
        self.indexer, self.decoder, self.pool, self.models = indexer, decoder, pool, models
        self.limit = max_tokens_limit
        self.prefixes = PrefixLookup(indexer)
        self.auto = AutoCache(indexer, self.prefixes, auto_cache_min_tokens)
        self.raw = RawPrefixes(indexer, self.prefixes.method, self.prefixes.params, auto_cache_min_tokens, TTL_S)
        self.unwritten = Unwritten(decoder, pool, indexer.backend.manifest)

    def _spec(self, req: SamplingBody, max_tokens: int | None, cid: str = _ANY_ID, default: int | None = None,
              **turn: Any) -> GenerateSpec:
        """max_tokens None: `default`, else the room the window leaves (up to --max-tokens-limit),
        as vLLM; given, a prompt plus max_tokens past the window is refused up front, as OpenAI."""
        request = _proto(req, cid, max_tokens or default or self.limit, **turn)
        spec = convert.generate_spec(request, self.limit, self.limit, self.indexer.lm.args.max_seq_len)
        return replace(spec, strict_window=max_tokens is not None)

    async def chat(self, caller: Caller, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        t0 = time.perf_counter()
        model = self.models.check(req.model)
        _refuse(req, chat=True)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(**m.plain()) for m in req.messages])
        spec = self._spec(req, req.max_completion_tokens or req.max_tokens, chat=chat)
        spec, made = await in_thread(self.pool, self._resolve_chat, caller, req.cached_content, spec)
        early = await built(made)
        if early is not None:  # decoded over its new context, as the next request with these messages will be
            made = early.made
            spec = replace(spec, context_id=made.context_id, turn=spec.turn[made.split:], prompt_tokens=())
        shape = Completion(model, spec.context_id, True, fresh=early is not None)
        return await self._answer(spec, shape, req, t0, early)

    def _resolve_chat(self, caller: Caller, reference: str | None,
                      spec: GenerateSpec) -> tuple[GenerateSpec, Registered | None]:
        """-> the spec (a miss: MISS and the whole prompt's tokens) and a miss's registered prefix."""
        if reference is not None:
            cid = context_reference(reference)
            contexts.check_readable(self.indexer, caller, cid)
            return replace(spec, context_id=cid), None
        match = self.prefixes.find(spec.turn, caller.tenant or "")
        if match is not None:
            return replace(spec, context_id=match.context_id, turn=spec.turn[match.n_messages:]), None
        made = self.auto.register(spec.turn, caller.tenant or "")
        alone = tuple(self.indexer.prompter.prompt_tokens(spec.turn))  # decoded so if its prefix's build fails
        return replace(spec, context_id=MISS, prompt_tokens=alone), made

    async def completion(self, caller: Caller, req: CompletionRequest) -> dict | AsyncIterator[str]:
        """A text completion: the prompt's tokens follow the cached context as they are, with no
        chat template (control tokens in it are the template's own, as in any raw completion).
        Without `cached_content`, the context holding the prompt's longest block-aligned prefix
        is used (raw_prefix.py); on a miss its long prefix is built as a context first and the
        rest decoded over it, as the next request will be; a prompt with none is decoded alone."""
        t0 = time.perf_counter()
        model = self.models.check(req.model)
        _refuse(req, chat=False)
        assert isinstance(req.prompt, str)  # the validator took the one prompt of a list
        cid = MISS if req.cached_content is None else context_reference(req.cached_content)
        spec = self._spec(req, req.max_tokens, cid or _ANY_ID, default=16, question=req.prompt)  # OpenAI's 16
        if cid != MISS:
            await in_thread(self.pool, contexts.check_readable, self.indexer, caller, cid)
        tokens = await in_thread(self.pool, self.indexer.prompter.encode, req.prompt)
        tenant, cached, early = caller.tenant or "", 0, None
        if cid == MISS:
            match = await in_thread(self.pool, self.raw.find, tokens, tenant)
            if match is not None:
                cid, cached = match.context_id, match.n_tokens
            elif (early := await built(await in_thread(self.pool, self.raw.register, tokens, tenant))) is not None:
                cid, cached = early.made.context_id, early.made.split
        spec = replace(spec, context_id=cid, prompt_tokens=tuple(tokens[cached:]))
        return await self._answer(spec, Completion(model, cid, False, fresh=early is not None), req, t0, early)

    async def _answer(self, spec: GenerateSpec, shape: Completion, req: SamplingBody, t0: float,
                      early: Early | None = None) -> dict | AsyncIterator[str]:
        """early: a miss's prefix, decoded from its build's artifact while its write goes on."""
        self.unwritten.watch(early)
        events = iterate_in_thread(self.pool, lambda alive: self.unwritten.stream(spec, alive, t0, early))
        if not req.stream:
            ids: list[int] = []
            async for event in events:
                if isinstance(event, Final):
                    return shape.whole(event, ids if req.return_token_ids else None)
                ids += event.token_ids
            raise AssertionError("a stream ends with its Final")  # pragma: no cover
        first = await anext(events)  # errors before the first token raise here, before any byte is sent
        return _sse(first, events, shape, req.include_usage(), req.return_token_ids)


async def _sse(first: Chunk | Final, events: AsyncIterator[Chunk | Final], shape: Completion,
               include_usage: bool, token_ids: bool) -> AsyncIterator[str]:
    """`data: <json>` per delta, the finish chunk (with usage unless a usage chunk follows),
    then `data: [DONE]`. A failure after the first byte is an error event (the status is sent);
    a client that goes away closes this generator, which stops the decode (rpc.iterate_in_thread)."""
    try:
        yield json.dumps(shape.opening())
        event = first
        while True:
            if isinstance(event, Final):
                yield json.dumps(shape.finish(event, with_usage=not include_usage))
                if include_usage:
                    yield json.dumps(shape.usage_chunk(event))
                break
            if event.text or (token_ids and event.token_ids):
                yield json.dumps(shape.text(event.text, event.token_ids if token_ids else None))
            event = await anext(events)
    except Exception as exc:  # noqa: BLE001 - in-band, in the one error shape
        yield json.dumps(error_body(exc)[1])
    finally:
        await events.aclose()
    yield "[DONE]"
