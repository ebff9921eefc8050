from ctxcache.client.gen.v1 import context_pb2 as _context_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EvictRequest(_message.Message):
    __slots__ = ("context_id", "memory_only", "device_only", "local_only")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ONLY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    memory_only: bool
    device_only: bool
    local_only: bool
    def __init__(self, context_id: _Optional[str] = ..., memory_only: _Optional[bool] = ..., device_only: _Optional[bool] = ..., local_only: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "bytes_freed")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    evicted: bool
    bytes_freed: int
    def __init__(self, evicted: _Optional[bool] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class RebuildRequest(_message.Message):
    __slots__ = ("context_id", "method", "allow_reprefill", "wait")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ALLOW_REPREFILL_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    method: _context_pb2.MethodSpec
    allow_reprefill: bool
    wait: bool
    def __init__(self, context_id: _Optional[str] = ..., method: _Optional[_Union[_context_pb2.MethodSpec, _Mapping]] = ..., allow_reprefill: _Optional[bool] = ..., wait: _Optional[bool] = ...) -> None: ...

class RebuildResponse(_message.Message):
    __slots__ = ("context", "reprefilled")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REPREFILLED_FIELD_NUMBER: _ClassVar[int]
    context: _context_pb2.ContextInfo
    reprefilled: bool
    def __init__(self, context: _Optional[_Union[_context_pb2.ContextInfo, _Mapping]] = ..., reprefilled: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("context_id", "repair")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    repair: bool
    def __init__(self, context_id: _Optional[str] = ..., repair: _Optional[bool] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("context_id", "ok", "problems", "marked_damaged")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    MARKED_DAMAGED_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    ok: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    marked_damaged: bool
    def __init__(self, context_id: _Optional[str] = ..., ok: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ..., marked_damaged: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("contexts_ready", "contexts_building", "contexts_failed", "store_bytes", "store_budget_bytes", "dram_cache_bytes", "dram_cache_entries", "active_streams", "build_queue", "registry", "registry_available", "model_id", "footprint", "decode_steps", "decode_rows", "device_slots", "device_slot_bytes", "offload_cache_hits", "offload_selected_keys", "decode_mode", "streams_by_decode_path", "resident_contexts", "offloaded_contexts", "offload_hit_rate", "offload_promotions", "offload_pcie_bytes", "offload_steps")
    class StreamsByDecodePathEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CONTEXTS_READY_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_BUILDING_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    BUILD_QUEUE_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROWS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_SELECTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MODE_FIELD_NUMBER: _ClassVar[int]
    STREAMS_BY_DECODE_PATH_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_PCIE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    contexts_ready: int
    contexts_building: int
    contexts_failed: int
    store_bytes: int
    store_budget_bytes: int
    dram_cache_bytes: int
    dram_cache_entries: int
    active_streams: int
    build_queue: int
    registry: str
    registry_available: bool
    model_id: str
    footprint: _containers.RepeatedCompositeFieldContainer[CodecFootprint]
    decode_steps: int
    decode_rows: int
    device_slots: int
    device_slot_bytes: int
    offload_cache_hits: int
    offload_selected_keys: int
    decode_mode: str
    streams_by_decode_path: _containers.ScalarMap[str, int]
    resident_contexts: int
    offloaded_contexts: int
    offload_hit_rate: float
    offload_promotions: int
    offload_pcie_bytes: int
    offload_steps: int
    def __init__(self, contexts_ready: _Optional[int] = ..., contexts_building: _Optional[int] = ..., contexts_failed: _Optional[int] = ..., store_bytes: _Optional[int] = ..., store_budget_bytes: _Optional[int] = ..., dram_cache_bytes: _Optional[int] = ..., dram_cache_entries: _Optional[int] = ..., active_streams: _Optional[int] = ..., build_queue: _Optional[int] = ..., registry: _Optional[str] = ..., registry_available: _Optional[bool] = ..., model_id: _Optional[str] = ..., footprint: _Optional[_Iterable[_Union[CodecFootprint, _Mapping]]] = ..., decode_steps: _Optional[int] = ..., decode_rows: _Optional[int] = ..., device_slots: _Optional[int] = ..., device_slot_bytes: _Optional[int] = ..., offload_cache_hits: _Optional[int] = ..., offload_selected_keys: _Optional[int] = ..., decode_mode: _Optional[str] = ..., streams_by_decode_path: _Optional[_Mapping[str, int]] = ..., resident_contexts: _Optional[int] = ..., offloaded_contexts: _Optional[int] = ..., offload_hit_rate: _Optional[float] = ..., offload_promotions: _Optional[int] = ..., offload_pcie_bytes: _Optional[int] = ..., offload_steps: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("context_id",)
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    def __init__(self, context_id: _Optional[str] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("context", "stored_bytes_by_part")
    class StoredBytesByPartEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_BY_PART_FIELD_NUMBER: _ClassVar[int]
    context: _context_pb2.ContextInfo
    stored_bytes_by_part: _containers.ScalarMap[str, int]
    def __init__(self, context: _Optional[_Union[_context_pb2.ContextInfo, _Mapping]] = ..., stored_bytes_by_part: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CodecFootprint(_message.Message):
    __slots__ = ("kv_codec", "contexts", "tokens", "stored_bytes", "resident_bytes", "stored_bytes_per_token", "resident_bytes_per_token")
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    kv_codec: str
    contexts: int
    tokens: int
    stored_bytes: int
    resident_bytes: int
    stored_bytes_per_token: float
    resident_bytes_per_token: float
    def __init__(self, kv_codec: _Optional[str] = ..., contexts: _Optional[int] = ..., tokens: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., stored_bytes_per_token: _Optional[float] = ..., resident_bytes_per_token: _Optional[float] = ...) -> None: ...

class ReconcileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReconcileResponse(_message.Message):
    __slots__ = ("registered", "removed", "damaged")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    registered: int
    removed: int
    damaged: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, registered: _Optional[int] = ..., removed: _Optional[int] = ..., damaged: _Optional[_Iterable[str]] = ...) -> None: ...
