"""Service configuration: one frozen dataclass per component (the indexer's in indexer/settings.py),
composed into ServiceConfig.

Flags are parsed only by the CLI; everything else receives these objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ctxcache.decoder.decode_mode import MODES
from ctxcache.indexer.settings import IndexerSettings

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port
    admin_port: int | None = None  # None: admin + reflection on the main port; 0: free port
    http_port: int | None = None  # the OpenAI-compatible HTTP front (service/http/); None: off; 0: free port
    # the HTTP front registers a missed chat's longest leading messages of at least this many
    # tokens as a context (OpenAI's automatic caching starts at 1,024); 0: never
    auto_cache_min_tokens: int = 1024
    max_message_bytes: int = 64 * MiB
    max_streams: int = 16  # concurrent Generate streams; more -> RESOURCE_EXHAUSTED
    threads: int = 64  # gRPC handler threads (streams + unary calls)
    auth_token: str | None = None  # the admin (operator) bearer token: every RPC, every tenant
    tenant_tokens: tuple[tuple[str, str], ...] = ()  # (token, tenant): that tenant's contexts only
    advertise: str = ""  # host:port the registry records for this worker; "" = host (or hostname):port
    tls_cert: Path | None = None
    tls_key: Path | None = None
    grace_seconds: float = 5.0
    reflection: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        for name in ("admin_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name}={value} must be in [0, 65535]")
        if self.auto_cache_min_tokens < 0:
            raise ValueError(f"auto_cache_min_tokens={self.auto_cache_min_tokens} must be >= 0 (0: off)")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be >= 1024")
        if self.max_streams < 1 or self.threads <= self.max_streams:
            raise ValueError(f"max_streams={self.max_streams} must be >= 1 and < threads={self.threads}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert={self.tls_cert} and tls_key={self.tls_key}: give both or neither")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must be non-empty when set")
        for token, tenant in self.tenant_tokens:
            if not token or token == self.auth_token:
                raise ValueError(f"tenant token of {tenant!r} must be non-empty and differ from the admin token")

    def advertised(self, port: int) -> str:
        """The address other workers and clients reach this one at (recorded in the registry)."""
        if self.advertise:
            return self.advertise
        import socket
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "[::]", "") else self.host
        return f"{host}:{port}"


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2"  # ctxcache.models.loader.load_model source
    device: str = "cpu"
    dtype: str = "float32"
    # a Jinja chat template for a tokenizer that has none (prompting.ensure_chat_template)
    chat_template: Path | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, float16 or bfloat16")


@dataclass(frozen=True)
class StoreSettings:
    path: Path = Path("./data")
    budget_bytes: int = 16 * GiB  # LRU eviction keeps stored artifacts under this
    # loads into page-locked memory (async copies of the coded K/V to HBM); None: when the
    # model is on a GPU
    pin_memory: bool | None = None
    # the page-locked host pool those loads land in, registered once at start (ctxcache/host_pool.py);
    # None: the DRAM cache plus assembly.POOL_SLACK (artifacts of loads in flight and of evicted ones that
    # streams still read)
    host_pool_bytes: int | None = None
    # the shared artifact tier (s3://bucket/prefix?endpoint_override=host:port&scheme=http or
    # file:///path): the copy of record, with the LMDB at `path` as this machine's cache of it
    # (budget_bytes is then the cache's budget). None: the LMDB alone, as on a single node
    object_store_uri: str | None = None
    object_budget_bytes: int | None = None  # the shared tier's budget; None: unbounded

    def __post_init__(self) -> None:
        if self.budget_bytes < MiB:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be >= 1 MiB")
        if self.host_pool_bytes is not None and self.host_pool_bytes < 0:
            raise ValueError(f"host_pool_bytes={self.host_pool_bytes} must be None or >= 0")
        if self.object_store_uri is not None:
            from ctxcache.store.tiers import tier_class

            tier_class(self.object_store_uri)  # an unknown scheme fails here, naming the URI
        if self.object_budget_bytes is not None and self.object_budget_bytes < MiB:
            raise ValueError(f"object_budget_bytes={self.object_budget_bytes} must be None or >= 1 MiB")


@dataclass(frozen=True)
class RegistrySettings:
    redis_url: str | None = None  # redis://[:password@]host:port/db; None: the embedded registry
    timeout_seconds: float = 0.2  # per connect / socket operation (fail fast)

    def __post_init__(self) -> None:
        if self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds={self.timeout_seconds} must be > 0")
        if self.redis_url is not None:
            self.redis_config()  # validates the URL now, not at first use

    def redis_config(self):
        from urllib.parse import urlparse

        from ctxcache.store import RedisConfig

        u = urlparse(self.redis_url or "")
        if u.scheme != "redis" or not u.hostname:
            raise ValueError(f"redis_url={self.redis_url!r} must look like redis://host:6379/0")
        db = u.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"redis_url={self.redis_url!r}: database {db!r} must be a number")
        return RedisConfig(host=u.hostname, port=u.port or 6379, db=int(db), password=u.password,
                           connect_timeout_s=self.timeout_seconds, socket_timeout_s=self.timeout_seconds)


@dataclass(frozen=True)
class DecoderSettings:
    dram_cache_bytes: int = 2 * GiB  # loaded artifacts kept in DRAM (LRU by bytes)
    schedule: str = "0.05-step-1"  # default sparse schedule
    default_max_tokens: int = 128
    max_tokens_limit: int = 4096
    torch_threads: int = 0  # 0: leave torch's default
    max_batch: int = 32  # live streams stepped together per decode step (continuous batching)
    # "auto": sparse where it decodes faster, dense where not (decoder/decode_mode.py: per device
    # and context length); "sparse"; "dense": the same engine attending to every cached key
    decode_mode: str = "auto"
    gpu_slots: int = 4  # GPU runner: contexts resident in HBM (and decoded together) at once
    gpu_slot_tokens: int = 33792  # GPU runner: tokens per slot (context + question + answer)
    # > 0: the slots are as many as this much HBM holds in the decode mode (decoder/gpu/capacity.py),
    # and gpu_slots is not used
    gpu_memory_bytes: int = 0
    # sparse on a GPU: contexts no slot holds decode with their K/V in pinned host memory
    # (decoder/gpu/offload_runner.py) instead of on the reference path
    offload: bool = False
    offload_slots: int = 4  # offloaded streams decoded together (host slots in one page-locked pool)
    offload_slot_tokens: int = 0  # tokens per host slot; 0: the model's length
    # "hbm": each host slot's K also in HBM (the re-rank and attention read it there; V alone
    # crosses PCIe); "host": K read over PCIe too (stage 1, no HBM for K)
    offload_k: str = "hbm"
    # V rows each host slot's GPU cache holds, per layer and KV head, as a multiple of the
    # selection: > 1 keeps keys that recent steps selected (decoder/gpu/offload.plan_slots). 8: H200,
    # 32K x 8 served 389.5 tok/s (hit rate 0.51, 219 MB a step over PCIe) against 370.2 with 4 (0.31, 312 MB)
    offload_v_cache: float = 8.0
    # an offloaded row's serial question prefill padded and replayed as CUDA graphs, as a resident
    # slot's (decoder/gpu/offload_prompt.py): hot TTFT at 32K through gRPC 40-42 ms against 75 eager (H200)
    offload_prefill_graphs: bool = True
    # on a GPU, warm up in a child process first (service/warm_up_check.py): a compiler crash is
    # then one line instead of the server's death by signal. Its cost is a second process and
    # model load: the child fills Triton's cache, so the server's own warm-up compiles nothing
    # (H200, random:tiny: child 32.4 s with 34 compilations, then the server's 1.3 s)
    warm_up_check: bool = True

    def __post_init__(self) -> None:
        if self.decode_mode not in MODES:
            raise ValueError(f"decoder.decode_mode={self.decode_mode!r} must be one of {MODES}")
        if self.gpu_memory_bytes < 0:
            raise ValueError(f"decoder.gpu_memory_bytes={self.gpu_memory_bytes} must be >= 0")
        if self.gpu_slots < 1 or self.gpu_slot_tokens < 2:
            raise ValueError(f"decoder.gpu_slots={self.gpu_slots} must be >= 1 and gpu_slot_tokens="
                             f"{self.gpu_slot_tokens} >= 2")
        if self.dram_cache_bytes < 0 or self.default_max_tokens < 1 or self.max_tokens_limit < 1:
            raise ValueError(f"dram_cache_bytes={self.dram_cache_bytes}, default_max_tokens="
                             f"{self.default_max_tokens}, max_tokens_limit={self.max_tokens_limit} invalid")
        if self.max_batch < 1:
            raise ValueError(f"decoder.max_batch={self.max_batch} must be >= 1")
        if self.offload_k not in ("hbm", "host"):
            raise ValueError(f"decoder.offload_k={self.offload_k!r} must be 'hbm' or 'host'")
        if not 1.0 <= self.offload_v_cache <= 64.0:
            raise ValueError(f"decoder.offload_v_cache={self.offload_v_cache} must be in [1, 64]")
        if self.offload_slots < 1 or self.offload_slot_tokens < 0:
            raise ValueError(f"decoder.offload_slots={self.offload_slots} must be >= 1 and offload_slot_tokens="
                             f"{self.offload_slot_tokens} >= 0")


ROLES = ("all", "indexer", "decoder")


@dataclass(frozen=True)
class FleetSettings:
    """Many workers on one Redis and one object store (service/roles.py); role "all" is one
    self-contained node: embedded registry (or Redis), local store, no object store needed."""

    role: str = "all"
    build_lease_s: float = 10.0  # a job whose indexer stopped beating this long goes to another
    heartbeat_s: float = 2.0  # hot memberships expire 3 heartbeats after a worker's last
    tombstone_s: float = 86400.0  # a deleted context's registry entry says DELETED this long
    gc_interval_s: float = 600.0  # indexers: the object store's GC, once per interval fleet-wide; 0: off
    gc_grace_s: float = 3600.0  # an unreferenced object is garbage once this old (longer than any write)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES}")
        for name in ("build_lease_s", "heartbeat_s", "tombstone_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fleet.{name}={getattr(self, name)} must be > 0")
        for name in ("gc_interval_s", "gc_grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"fleet.{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class ServiceConfig:
    server: ServerConfig = ServerConfig()
    model: ModelConfig = ModelConfig()
    store: StoreSettings = StoreSettings()
    registry: RegistrySettings = RegistrySettings()
    indexer: IndexerSettings = IndexerSettings()
    decoder: DecoderSettings = DecoderSettings()
    fleet: FleetSettings = FleetSettings()

    def __post_init__(self) -> None:
        role = self.fleet.role
        if role != "all" and (self.registry.redis_url is None or self.store.object_store_uri is None):
            raise ValueError(f"--role {role} needs --redis (the registry and job stream) and --object-store "
                             f"(the artifacts every worker shares); got redis={self.registry.redis_url!r}, "
                             f"object_store={self.store.object_store_uri!r}")
        if role == "indexer" and self.server.http_port is not None:
            # an indexer serves no PutContext or Generate: an HTTP front there would only fail
            raise ValueError("--role indexer serves no requests: --http-port belongs on a decoder (or --role all)")
