"""The one sparse-attention interface: build offline from the prefill, search online per step.

Every method is one small class. `build` turns one layer's prefill Q/K/V into named tables
(plain tensors, so the store can serialise them without knowing the method); `build_layers`
is what the indexer calls for a whole context, so a method with a device build (CSAttention on
a GPU) chooses it there without the indexer knowing the method. `open` makes a
per-stream state over those tables; the tables themselves stay read-only so that concurrent
streams share one artifact. `search` picks token indices in the middle region for one decode
query; `attend` (default: exact attention over sinks + search + recent window) is overridden
by estimator methods that approximate the attention output instead of selecting a subset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
import math
import re
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch

from ctxcache.methods.budget import Budget
from ctxcache.models.attention import gather_attention

Tables = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Capabilities:
    """What a method needs and does, in one place instead of scattered flags."""

    uses_queries: bool = False  # build() needs the prefill queries
    reads_all_keys: bool = False  # search() scans every cached key (oracle-style references)
    streaming: bool = False  # append() indexes keys generated during decode
    estimator: bool = False  # attend() approximates the output rather than selecting keys
    gpu_decode: bool = False  # the fast GPU runner can decode it (see SparseMethod.gpu_decodable)


@dataclass
class LayerState:
    """A stream's view of one layer: the shared tables plus what this stream appended."""

    tables: Tables
    extra: dict[str, Any] = field(default_factory=dict)


class ParamError(ValueError):
    """A method parameter out of type or bounds; `field` names it (the service reports it)."""

    def __init__(self, field_name: str, why: str) -> None:
        super().__init__(why)
        self.field = field_name


INT_LIMIT = 1 << 31  # a parameter int outside (-2^31, 2^31) is a mistake, never a setting
MAX_STR = 64


def _check_value(f: Field, value: Any, bounds: tuple[float, float] | None) -> None:
    """Type (from the annotation: int, float, bool, str, `| None`), finiteness and bounds."""
    kinds = {t.strip() for t in str(f.type).split("|")}
    if value is None:
        if "None" not in kinds:
            raise ParamError(f.name, f"{f.name}=None: must not be null")
        return
    if isinstance(value, bool):
        ok = "bool" in kinds
    elif isinstance(value, int):
        ok = bool(kinds & {"int", "float"})
    elif isinstance(value, float):
        ok = "float" in kinds
    elif isinstance(value, str):
        ok = "str" in kinds
    else:
        ok = False
    if isinstance(value, str) and len(value) > MAX_STR:
        raise ParamError(f.name, f"{f.name}: {len(value)} characters; at most {MAX_STR}")
    if not ok:
        raise ParamError(f.name, f"{f.name}={str(value)[:MAX_STR]!r} ({type(value).__name__}) must be {f.type}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ParamError(f.name, f"{f.name}={value} must be finite")
        lo, hi = bounds or (-INT_LIMIT + 1, INT_LIMIT - 1)
        if not lo <= value <= hi:
            raise ParamError(f.name, f"{f.name}={value:.6g} must be in [{lo}, {hi}]")


@dataclass(frozen=True)
class MethodParams:
    """Base for each method's frozen parameter dataclass.

    BOUNDS: inclusive [lo, hi] per numeric field, checked (with the annotated type) by
    `from_dict` before construction, so a request can never ask for a build that runs for
    hours (kmeans_iters=1e9) or fails later (centroids=2.5): every value a client can send is
    refused up front, with the field named."""

    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {}
    # fields added after contexts were stored, left out of to_dict while at their default: a
    # context id hashes the parameters (store/ids.py), so contexts that never set them keep theirs
    QUIET_DEFAULTS: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        defaults = {f.name: f.default for f in fields(self) if f.name in self.QUIET_DEFAULTS}
        return {k: v for k, v in values.items() if k not in defaults or v != defaults[k]}

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "MethodParams":
        values = dict(values or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown parameter(s) {[str(u)[:MAX_STR] for u in unknown[:8]]} for "
                             f"{cls.__name__}; known: {sorted(known)}")
        for name, value in values.items():
            _check_value(known[name], value, cls.BOUNDS.get(name))
        try:
            return cls(**values)
        except ParamError:
            raise
        except (ValueError, TypeError) as exc:  # the dataclass's own cross-field checks
            named = re.match(r"(\w+)=", str(exc))
            raise ParamError(named.group(1) if named else "params", str(exc)) from exc


class SparseMethod(ABC):
    name: ClassVar[str]
    Params: ClassVar[type[MethodParams]]
    caps: ClassVar[Capabilities] = Capabilities()
    # parameters that change only search, not build: artifacts built with other values serve
    search_params: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, params: MethodParams | None = None) -> None:
        self.params = params if params is not None else self.Params()

    @abstractmethod
    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        """Index one layer. q [Hq, N, D], k and v [Hkv, N, D] (post-RoPE) -> named tables."""

    def build_layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    n_layers: int) -> Tables:
        """Index layer `layer` of `n_layers`: what the indexer and the benches call. The
        default ignores the position (`build`); methods whose tables depend on the layer
        (pre-hoc PSAW) override it."""
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer={layer} must be in [0, n_layers={n_layers})")
        return self.build(q, k, v)

    def check_model(self, head_dim: int) -> None:
        """Raise ParamError if these parameters cannot index a model with this head_dim."""

    def gpu_decodable(self, tables: Tables) -> bool:
        """Whether the fast GPU runner (Triton selection + split-K attention) can decode from
        these tables; methods without a GPU selector decode on the reference path."""
        return False

    def build_layers(self, layers: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     n_layers: int) -> Iterator[Tables]:
        """Index every layer of a context: `layers` yields each layer's (q [Hq, N, D], k and v
        [Hkv, N, D]), in order, on any device; yields each layer's tables on the CPU, in order.
        The default builds on the CPU, one layer at a time (build_layer); methods with a
        device build override it."""
        for layer, (q, k, v) in enumerate(layers):
            yield self.build_layer(q.float().cpu(), k.float().cpu(), v.float().cpu(), layer, n_layers)

    def persist(self, tables: Tables) -> Tables:
        """What of one layer's tables the artifact stores: the compact state from which
        `restore` derives the rest. Default: everything (nothing is derivable)."""
        return tables

    def restore(self, tables: Tables, k: torch.Tensor, on_demand: bool = False) -> Tables:
        """One layer's full tables from its stored state and cached keys k [Hkv, N, D], on k's
        device (the device that decodes). Idempotent: tables that already hold the derived
        arrays (built in memory, or an artifact of format 1) come back as they are.
        on_demand: the caller decodes through this method's own search (the reference path),
        so the method may derive lazily what a step reads instead of everything at load."""
        return tables

    def build_work(self, n_tokens: int, n_heads: int, n_kv_heads: int) -> float:
        """Clustering work of one layer's build, in point-centroid distances (k-means: points x
        centroids x (iterations + seeding)): what parameters make expensive beyond the prefill,
        checked against a server's limit before a build is queued. 0: no clustering."""
        return 0.0

    def derived_bytes(self, n_tokens: int, n_kv_heads: int) -> int:
        """Bytes per layer that `restore` adds to the stored tables: resident, never stored."""
        return 0

    def open(self, tables: Tables) -> LayerState:
        return LayerState(tables=tables)

    @abstractmethod
    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        """Pick up to k indices in [lo, hi) per KV head for queries q [Hq, D].

        keys [Hkv, n, D] are the cached keys; only methods whose caps say reads_all_keys may
        read them beyond the indices they return. -> idx [Hkv, min(k, hi - lo)] long (wider, -1
        where a head has fewer, where a method attends more than k: CSAttention's carried steps).
        """

    @property
    def observes_dense(self) -> bool:
        """Whether observe_dense does something (the decoder skips the call otherwise)."""
        return False

    def observe_dense(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int) -> None:
        """A dense step's last query q [Hq, D] over keys [Hkv, n, D] (a prompt prefilled after
        the cached context, the step before the first search), for methods whose search carries
        state from step to step; [lo, hi) is the next search's region. Default: nothing."""

    def search_reads(self, k: int, region: int) -> int:
        """Cached keys per KV head whose K a search for k keys in a region of `region` keys
        reads, those it returns included (more when it re-ranks candidates by their keys)."""
        return min(k, region)

    def attend_reads(self, k: int, region: int) -> int:
        """Cached keys per KV head whose V a step attends (past the sinks and the recent window)."""
        return min(k, region)

    def index_read_bytes(self, n_tokens: int, n_kv_heads: int, group: int) -> int:
        """Bytes of its own tables (not K/V) a search reads per step and layer over n_tokens
        cached keys, for n_kv_heads KV heads of `group` query heads each (0: none counted)."""
        return 0

    def append(self, state: LayerState, k_new: torch.Tensor, start: int) -> None:
        """Index keys k_new [Hkv, T, D] generated at positions start..start+T-1."""

    def attend(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, n: int, budget: Budget) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output [Hq, D] for q [Hq, D] over the first n cached keys, and the
        indices [Hkv, K'] it read."""
        idx = self.select(state, q, keys, n, budget)
        return gather_attention(q, keys, values, idx.clamp(min=0), idx >= 0), idx

    def select(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, n: int,
               budget: Budget) -> torch.Tensor:
        """Sinks + searched middle + recent window: [Hkv, K'] distinct indices (-1: none)."""
        lo, hi = budget.region(n)
        static = budget.static_indices(n, q.device).expand(keys.shape[0], -1)
        if hi <= lo:
            return static
        found = self.search(state, q, keys[:, :n], lo, hi, budget.top_k(n))
        return torch.cat([static, found], dim=1)
