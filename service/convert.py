"""Proto <-> domain translation with validation: every bad field raises InvalidArgument(field)."""

from __future__ import annotations

import math
import re
from typing import Any

from google.protobuf import struct_pb2

from ctxcache.artifact import KV_CODECS
from ctxcache.generation import SamplingParams
from ctxcache.methods import ParamError, make_method
from ctxcache.decoder.stream_spec import GenerateSpec
from ctxcache.errors import InvalidArgument, PermissionDenied
from ctxcache.indexer.job_spec import PutSpec
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.prompting import ROLES, Messages, document_messages, text_messages

_CONTEXT_ID = re.compile(r"[0-9a-f]{64}")
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}")
_TENANT = re.compile(r"[A-Za-z0-9_.\-]{0,64}")
RESERVED_LABEL = "ctxcache/"  # labels the service keeps for itself (e.g. the context's roles)
MAX_LABELS, MAX_LABEL_VALUE, MAX_STOPS, MAX_STOP_CHARS, MAX_PAGE = 64, 256, 8, 64, 1000
MAX_NAME = 64  # method names and schedules
BYTES_PER_TOKEN = 32  # no vocabulary token spans more bytes: text past limit x this is refused untokenized
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0  # 1e-37 overflows the softmax to inf/nan


def context_id(value: str, name: str = "context_id") -> str:
    if not _CONTEXT_ID.fullmatch(value):
        raise InvalidArgument(name, f"{value[:80]!r} is not a context id (64 lowercase hex characters)")
    return value


def check_size(name: str, texts: list[str], max_tokens: int, message_tokens: int = 0) -> None:
    """Refuse what cannot fit in max_tokens before spending CPU on tokenizing it. A lower bound
    of its tokens: each text (tokenized apart) at least 1 per BYTES_PER_TOKEN characters, and
    each message after the first the template's message_tokens (Prompter.message_tokens)."""
    least = sum(-(-len(t) // BYTES_PER_TOKEN) for t in texts) + message_tokens * max(0, len(texts) - 1)
    if least > max_tokens:
        raise InvalidArgument(name, f"{sum(len(t) for t in texts)} characters in {len(texts)} texts make at least "
                              f"{least} tokens ({message_tokens} template tokens per message), counted without "
                              f"tokenizing; at most {max_tokens} tokens are accepted")


def _messages(chat: pb.ChatMessages, name: str) -> Messages:
    if not chat.messages:
        raise InvalidArgument(f"{name}.messages", "must hold at least one message")
    out = []
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"{name}.messages[{i}].role", f"{m.role[:80]!r} must be one of {ROLES}")
        if not m.content.strip():
            raise InvalidArgument(f"{name}.messages[{i}].content", "must not be empty")
        out.append({"role": m.role, "content": m.content})
    return out


def _content(req: pb.PutContextRequest) -> Messages:
    kind = req.WhichOneof("content")
    if kind is None:
        raise InvalidArgument("content", "set one of text, chat, documents")
    if kind == "text":
        if not req.text.strip():
            raise InvalidArgument("text", "must not be empty")
        return text_messages(req.text)
    if kind == "chat":
        return _messages(req.chat, "chat")
    if not req.documents.documents:
        raise InvalidArgument("documents.documents", "must hold at least one document")
    docs = []
    for i, d in enumerate(req.documents.documents):
        if not d.text.strip():
            raise InvalidArgument(f"documents.documents[{i}].text", "must not be empty")
        docs.append((d.title or d.id, d.text))
    return document_messages(docs)


def _texts(req: pb.PutContextRequest) -> list[str]:
    kind = req.WhichOneof("content")
    if kind == "text":
        return [req.text]
    if kind == "chat":
        return [m.content for m in req.chat.messages]
    if kind == "documents":
        return [d.text + d.title + d.id for d in req.documents.documents]
    return []


def _labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument("labels", f"{len(labels)} labels; at most {MAX_LABELS}")
    for k, v in labels.items():
        if not _LABEL_KEY.fullmatch(k) or k.startswith(RESERVED_LABEL):
            raise InvalidArgument("labels", f"key {k[:80]!r} must match {_LABEL_KEY.pattern} "
                                  f"and not start with {RESERVED_LABEL!r}")
        if len(v) > MAX_LABEL_VALUE:
            raise InvalidArgument("labels", f"value of {k!r} is {len(v)} characters; at most {MAX_LABEL_VALUE}")
    return dict(labels)


MAX_DEPTH = 8  # nested Struct levels accepted in method params (deeper: INVALID_ARGUMENT)


def _value(v: struct_pb2.Value, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise InvalidArgument("method.params", f"nested deeper than {MAX_DEPTH} levels")
    kind = v.WhichOneof("kind")
    if kind == "number_value":  # Struct numbers are doubles: integral ones become ints (params are typed)
        x = v.number_value
        return int(x) if math.isfinite(x) and x.is_integer() else x
    if kind == "struct_value":
        return {k: _value(x, depth + 1) for k, x in v.struct_value.fields.items()}
    if kind == "list_value":
        return [_value(x, depth + 1) for x in v.list_value.values]
    if kind in ("string_value", "bool_value"):
        return getattr(v, kind)
    return None


def struct_to_dict(s: struct_pb2.Struct) -> dict[str, Any]:
    """Struct -> dict without a JSON round trip (NaN and infinities reach the typed checks)."""
    return {k: _value(v, 1) for k, v in s.fields.items()}


def dict_to_struct(d: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({k: v for k, v in d.items()})
    return s


def method_spec(spec: pb.MethodSpec, default: str, default_params: dict[str, Any]) -> tuple[str, dict]:
    """-> (method name, full parameter dict) validated by constructing the method."""
    name = spec.name or default
    params = struct_to_dict(spec.params) if spec.name else {**default_params, **struct_to_dict(spec.params)}
    if len(name) > MAX_NAME:
        raise InvalidArgument("method.name", f"{len(name)} characters; at most {MAX_NAME}")
    try:
        method = make_method(name, params)
    except ParamError as exc:
        raise InvalidArgument(f"method.params.{exc.field}", str(exc)) from exc
    except ValueError as exc:
        bad = "method.name" if "unknown method" in str(exc) else "method.params"
        raise InvalidArgument(bad, str(exc)) from exc
    except TypeError as exc:
        raise InvalidArgument("method.params", str(exc)) from exc
    return method.name, method.params.to_dict()


def kv_codec(value: str, default: str) -> str:
    if value and value not in KV_CODECS:
        raise InvalidArgument("kv_codec", f"{value[:40]!r} must be one of {KV_CODECS} (or empty: {default!r})")
    return value or default


def put_spec(req: pb.PutContextRequest, default_method: str, default_params: dict[str, Any],
             caller_tenant: str | None = None, max_tokens: int = 1 << 20, default_codec: str = "int8",
             message_tokens: int = 0) -> PutSpec:
    """caller_tenant: the tenant bound to the caller's token (None: admin or an open server,
    which may name any tenant in the request); message_tokens: see check_size."""
    if not _TENANT.fullmatch(req.tenant):
        raise InvalidArgument("tenant", f"{req.tenant[:80]!r} must match {_TENANT.pattern}")
    tenant = req.tenant
    if caller_tenant is not None:
        if req.tenant and req.tenant != caller_tenant:
            raise PermissionDenied(f"tenant: {req.tenant!r} is not the tenant of this token")
        tenant = caller_tenant
    check_size("content", _texts(req), max_tokens, message_tokens if req.WhichOneof("content") == "chat" else 0)
    messages = _content(req)
    name, params = method_spec(req.method, default_method, default_params)
    return PutSpec(messages, _labels(dict(req.labels)), float(req.ttl_seconds) if req.ttl_seconds else None,
                   req.pin, name, params, req.wait, tenant, kv_codec(req.kv_codec, default_codec),
                   req.keep_queries)


def _sampling(s: pb.SamplingParams, default_max: int, limit: int) -> SamplingParams:
    if not math.isfinite(s.temperature) or not (s.temperature == 0 or MIN_TEMPERATURE <= s.temperature <= MAX_TEMPERATURE):
        raise InvalidArgument("sampling.temperature", f"{s.temperature:.6g} must be 0 (greedy) or in "
                              f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
    top_p = s.top_p or 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"{s.top_p} must be in (0, 1] (0 means 1)")
    if s.max_tokens > limit:
        raise InvalidArgument("sampling.max_tokens", f"{s.max_tokens} exceeds the limit {limit}")
    seed = s.seed if s.HasField("seed") else None
    return SamplingParams(float(s.temperature), float(top_p), s.max_tokens or default_max, (), seed)


def _stops(stops) -> tuple[str, ...]:
    if len(stops) > MAX_STOPS:
        raise InvalidArgument("stop", f"{len(stops)} stop sequences; at most {MAX_STOPS}")
    for i, s in enumerate(stops):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def generate_spec(req: pb.GenerateRequest, default_max: int, limit: int, max_tokens: int = 1 << 20,
                  message_tokens: int = 0) -> GenerateSpec:
    """max_tokens: the model's length; a turn longer than it could ever be is refused untokenized
    (message_tokens: see check_size)."""
    cid = context_id(req.context_id)
    if len(req.schedule) > MAX_NAME:
        raise InvalidArgument("schedule", f"{len(req.schedule)} characters; at most {MAX_NAME}")
    kind = req.WhichOneof("turn")
    if kind == "question":
        check_size("question", [req.question], max_tokens)
    else:
        check_size("chat", [m.content for m in req.chat.messages], max_tokens, message_tokens)
    if kind is None:
        raise InvalidArgument("turn", "set question or chat")
    if kind == "question":
        if not req.question.strip():
            raise InvalidArgument("question", "must not be empty")
        turn = [{"role": "user", "content": req.question}]
    else:
        turn = _messages(req.chat, "chat")
        if turn[-1]["role"] != "user":
            raise InvalidArgument("chat.messages", "the last message must have role 'user'")
    return GenerateSpec(cid, turn, _sampling(req.sampling, default_max, limit), _stops(req.stop), req.schedule)


def page(req) -> tuple[int, str]:
    if req.page_size > MAX_PAGE:
        raise InvalidArgument("page_size", f"{req.page_size} exceeds {MAX_PAGE}")
    if req.page_token:
        context_id(req.page_token, "page_token")
    return req.page_size or 100, req.page_token
