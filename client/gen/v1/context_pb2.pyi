from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContextState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTEXT_STATE_UNSPECIFIED: _ClassVar[ContextState]
    CONTEXT_STATE_BUILDING: _ClassVar[ContextState]
    CONTEXT_STATE_READY: _ClassVar[ContextState]
    CONTEXT_STATE_FAILED: _ClassVar[ContextState]
    CONTEXT_STATE_DAMAGED: _ClassVar[ContextState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LIMIT: _ClassVar[FinishReason]
CONTEXT_STATE_UNSPECIFIED: ContextState
CONTEXT_STATE_BUILDING: ContextState
CONTEXT_STATE_READY: ContextState
CONTEXT_STATE_FAILED: ContextState
CONTEXT_STATE_DAMAGED: ContextState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CONTEXT_LIMIT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "title", "text")
    ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    id: str
    title: str
    text: str
    def __init__(self, id: _Optional[str] = ..., title: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class Documents(_message.Message):
    __slots__ = ("documents",)
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    def __init__(self, documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ...) -> None: ...

class MethodSpec(_message.Message):
    __slots__ = ("name", "params")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class PutContextRequest(_message.Message):
    __slots__ = ("text", "chat", "documents", "labels", "ttl_seconds", "pin", "method", "wait", "tenant", "kv_codec", "keep_queries")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    KEEP_QUERIES_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    documents: Documents
    labels: _containers.ScalarMap[str, str]
    ttl_seconds: int
    pin: bool
    method: MethodSpec
    wait: bool
    tenant: str
    kv_codec: str
    keep_queries: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., documents: _Optional[_Union[Documents, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., ttl_seconds: _Optional[int] = ..., pin: _Optional[bool] = ..., method: _Optional[_Union[MethodSpec, _Mapping]] = ..., wait: _Optional[bool] = ..., tenant: _Optional[str] = ..., kv_codec: _Optional[str] = ..., keep_queries: _Optional[bool] = ...) -> None: ...

class ContextInfo(_message.Message):
    __slots__ = ("context_id", "state", "progress", "error", "n_tokens", "method", "method_params", "labels", "pin", "ttl_seconds", "created_unix_ms", "artifact_bytes", "raw_kv_bytes", "model_id", "kv_codec", "format_version", "artifact_uri", "hot_workers")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METHOD_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_URI_FIELD_NUMBER: _ClassVar[int]
    HOT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    state: ContextState
    progress: float
    error: str
    n_tokens: int
    method: str
    method_params: _struct_pb2.Struct
    labels: _containers.ScalarMap[str, str]
    pin: bool
    ttl_seconds: int
    created_unix_ms: int
    artifact_bytes: int
    raw_kv_bytes: int
    model_id: str
    kv_codec: str
    format_version: int
    artifact_uri: str
    hot_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, context_id: _Optional[str] = ..., state: _Optional[_Union[ContextState, str]] = ..., progress: _Optional[float] = ..., error: _Optional[str] = ..., n_tokens: _Optional[int] = ..., method: _Optional[str] = ..., method_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., pin: _Optional[bool] = ..., ttl_seconds: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., artifact_bytes: _Optional[int] = ..., raw_kv_bytes: _Optional[int] = ..., model_id: _Optional[str] = ..., kv_codec: _Optional[str] = ..., format_version: _Optional[int] = ..., artifact_uri: _Optional[str] = ..., hot_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class PutContextResponse(_message.Message):
    __slots__ = ("context", "created")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    context: ContextInfo
    created: bool
    def __init__(self, context: _Optional[_Union[ContextInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetContextRequest(_message.Message):
    __slots__ = ("context_id",)
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    def __init__(self, context_id: _Optional[str] = ...) -> None: ...

class ListContextsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListContextsResponse(_message.Message):
    __slots__ = ("contexts", "next_page_token")
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    contexts: _containers.RepeatedCompositeFieldContainer[ContextInfo]
    next_page_token: str
    def __init__(self, contexts: _Optional[_Iterable[_Union[ContextInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteContextRequest(_message.Message):
    __slots__ = ("context_id",)
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    def __init__(self, context_id: _Optional[str] = ...) -> None: ...

class DeleteContextResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("context_id", "question", "chat", "sampling", "stop", "schedule")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    question: str
    chat: ChatMessages
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    schedule: str
    def __init__(self, context_id: _Optional[str] = ..., question: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., schedule: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("cached_tokens", "new_prompt_tokens", "generated_tokens")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    new_prompt_tokens: int
    generated_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ..., new_prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft_seconds", "tokens_per_second", "load_seconds", "total_seconds", "cache_hit")
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    ttft_seconds: float
    tokens_per_second: float
    load_seconds: float
    total_seconds: float
    cache_hit: bool
    def __init__(self, ttft_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., load_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., cache_hit: _Optional[bool] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("usage", "timings", "finish_reason", "text", "decode_path")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DECODE_PATH_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    timings: Timings
    finish_reason: FinishReason
    text: str
    decode_path: str
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., text: _Optional[str] = ..., decode_path: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    final: Final
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...
