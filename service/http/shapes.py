"""Response bodies in OpenAI's shape (chat and text completions, whole and streamed) and the
cache resource in Gemini's (cachedContents), built from the domain's records."""

from __future__ import annotations

import datetime
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service import convert
from ctxcache.decoder.stream_spec import Final

_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "context_limit": "length"}
_STATE = {pb.CONTEXT_STATE_BUILDING: "BUILDING", pb.CONTEXT_STATE_READY: "READY", pb.CONTEXT_STATE_FAILED: "FAILED",
          pb.CONTEXT_STATE_DAMAGED: "DAMAGED"}


def usage(final: Final, fresh: bool = False) -> dict[str, Any]:
    """cached_tokens is always there, 0 included: clients read it to see what the cache saved.
    fresh: the context was built for this request (a miss's prefix), so none of it was saved."""
    prompt = final.cached_tokens + final.new_prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": final.generated_tokens,
            "total_tokens": prompt + final.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": 0 if fresh else final.cached_tokens}}


@dataclass
class Completion:
    """One response's identity and the builders of its bodies. chat: chat.completion, else
    text_completion; fresh: its context was built for it (usage counts no cached tokens)."""
    model: str
    context_id: str
    chat: bool
    fresh: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model,
                "cached_content": self.context_id or None}  # ctxcache's own: the context the prompt continued

    def whole(self, final: Final, token_ids: list[int] | None = None) -> dict[str, Any]:
        reason = _FINISH[final.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": final.text, "logprobs": None, "finish_reason": reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(final, self.fresh)}

    def chunk(self, delta: dict[str, Any] | str, reason: str | None = None) -> dict[str, Any]:
        """A streamed piece: chat takes a delta ({role} / {content} / {}), text takes its text."""
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def opening(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""} if self.chat else "")

    def text(self, text: str, token_ids: tuple[int, ...] | None = None) -> dict[str, Any]:
        body = self.chunk({"content": text} if self.chat else text)
        if token_ids is not None:
            body["choices"][0]["token_ids"] = list(token_ids)
        return body

    def finish(self, final: Final, with_usage: bool) -> dict[str, Any]:
        """The choice's last chunk; it carries the usage unless a usage chunk follows."""
        body = self.chunk({} if self.chat else "", _FINISH[final.finish_reason])
        return {**body, "usage": usage(final, self.fresh)} if with_usage else body

    def usage_chunk(self, final: Final) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with no choices, as OpenAI sends it."""
        return {**self.chunk({} if self.chat else ""), "choices": [], "usage": usage(final, self.fresh)}


def _time(unix_ms: int) -> str | None:
    if not unix_ms:
        return None
    t = datetime.datetime.fromtimestamp(unix_ms / 1000, datetime.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def cached_content(info: pb.ContextInfo) -> dict[str, Any]:
    """A cached context as Gemini's cachedContents resource (snake_case, as its SDKs write it)."""
    ttl = info.ttl_seconds or None
    created = _time(info.created_unix_ms)
    expires = _time(info.created_unix_ms + ttl * 1000) if ttl and info.created_unix_ms else None
    return {"name": f"cachedContents/{info.context_id}", "id": info.context_id, "object": "cached_content",
            "model": info.model_id, "state": _STATE.get(info.state, "STATE_UNSPECIFIED"),
            "progress": round(float(info.progress), 4), "error": info.error or None,
            "usage_metadata": {"total_token_count": info.n_tokens}, "create_time": created,
            "expire_time": expires, "labels": dict(info.labels),
            "method": {"name": info.method, "params": convert.struct_to_dict(info.method_params)},
            "codec": info.kv_codec, "pinned": info.pin, "stored_bytes": info.artifact_bytes}
