"""Generate streams over cached artifacts (bounded, cancellable, timed).

A stream acquires its artifact from the DRAM cache before decoding anything, so it either
holds a complete artifact for its whole life or fails (NOT_FOUND / DATA_LOSS) before its
first token. Each stream goes to the first decode engine whose runner accepts it (on a GPU the
fast runner, else the reference runner), which prefills its question in the gRPC handler
thread, samples its first token there, then steps it with every live stream of that engine as
one batch; the handler thread streams its tokens out and checks cancellation and its deadline
while it waits. The Final message and the metrics name the runner that served the stream.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace

from ctxcache.artifact import ContextArtifact
from ctxcache.landing import wait_landed
from ctxcache.decoder import SparseConfig
from ctxcache.decoder.decode_mode import check_mode, decode_path, resolve
from ctxcache.decoder.engine import Engine
from ctxcache.decoder.runner import ContextNotResident, Runner
from ctxcache.decoder.scheduler import OFFLOADED, HeldSlot, Placement
from ctxcache.models.loader import LoadedModel
from ctxcache.decoder.artifact_cache import ArtifactCache, Loaded
from ctxcache.decoder.cached_context import CachedContext
from ctxcache.store import request_deadline
from ctxcache.errors import (Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted,
                             Unavailable)
from ctxcache.metrics import Metrics
from ctxcache.prompting import Prompter
from ctxcache.decoder.textstream import TextStream
from ctxcache.decoder.uncached import MISS, empty_context
from ctxcache.decoder.stream_spec import Chunk, Final, GenerateSpec


_ROLES_KEPT = 4096  # contexts whose roles are remembered for a Generate that skips the DRAM tier


class GenerateStreams:
    def __init__(self, lm: LoadedModel, prompter: Prompter, cache: ArtifactCache[CachedContext],
                 max_streams: int, default_schedule: str, metrics: Metrics, runners: list[Runner],
                 max_batch: int = 32, decode_mode: str = "auto") -> None:
        """runners: in order of preference; a stream goes to the first that accepts it (the
        last should be the reference runner, which accepts every method and schedule).
        decode_mode: sparse; dense (every layer attends to every key, the baseline); auto:
        either, per stream, by the model's device and the context's length (decoder/decode_mode)."""
        self.lm, self.prompter, self.cache, self.metrics = lm, prompter, cache, metrics
        self.engines = [Engine(r, max_batch) for r in runners]
        self.default_schedule, self.decode_mode = default_schedule, check_mode(decode_mode)
        self.device_type = lm.model.lm_head.weight.device.type
        self.streams_by_path: Counter[str] = Counter()  # Generate streams by Final.decode_path, since start
        self._slots = threading.BoundedSemaphore(max_streams)
        self._closing = threading.Event()
        self._closing_reason = ""
        self.active = 0
        self._lock = threading.Lock()
        self._roles: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # context id -> its roles
        self._empty = Loaded(empty_context(lm), False, 0.0)  # what a miss (MISS) decodes after
        self.placement = Placement()  # resident or offloaded, where both runners take a stream
        self.promotions = 0  # streams whose context moved from a host slot to an HBM slot

    def stream(self, spec: GenerateSpec, alive: Callable[[], bool], deadline: float | None,
               t_request: float, context: CachedContext | None = None) -> Iterator[Chunk | Final]:
        """deadline: time.monotonic() value or None. Raises ResourceExhausted when full.
        context: spec.context_id's artifact as its build made it, not yet in the store (a miss
        that waited on that build): decoded from as a loaded one, bypassing the DRAM cache, which
        holds only stored contexts."""
        if not self._slots.acquire(blocking=False):
            self.metrics.rejected.labels("Generate").inc()
            raise ResourceExhausted("too many concurrent Generate streams; retry later")
        with self._lock:
            self.active += 1
        self.metrics.streams.inc()

        def alive_unless_closing() -> bool:
            if self._closing.is_set():
                raise Unavailable(self._closing_reason)
            return alive()
        try:
            with request_deadline(deadline):  # a cold load's object-store calls end by it too
                yield from self._run(spec, alive_unless_closing, deadline, t_request, context)
        finally:
            self.metrics.streams.dec()
            with self._lock:
                self.active -= 1
            self._slots.release()

    def adopt(self, context_id: str, context: CachedContext, stored: Callable[[], bool]) -> bool:
        """Hold a context a stream decoded from its build, once stored (stored() checks), as a
        load would: the next stream of it is a DRAM hit, or starts from the slot it left."""
        if not self.cache.offer(context_id, context, stored):
            return False
        self._remember_roles(context_id, context.roles)
        return True

    def evict(self, context_id: str) -> int:
        """Drop a context from DRAM and from every runner's device memory; -> DRAM bytes freed."""
        self.evict_device(context_id)
        with self._lock:
            self._roles.pop(context_id, None)
        return self.cache.evict(context_id)

    def evict_device(self, context_id: str) -> bool:
        """Release the context's device slots, keeping its DRAM copy; -> whether any held it."""
        return any([engine.runner.evict(context_id) for engine in self.engines])  # a list: every runner

    def decode_counts(self) -> tuple[int, int]:
        """(batched steps run, stream rows stepped) since start, over every engine."""
        return sum(e.steps for e in self.engines), sum(e.rows_stepped for e in self.engines)

    def decode_streams(self) -> dict[str, int]:
        """Generate streams since start by the path that decoded them (Final.decode_path)."""
        with self._lock:
            return dict(self.streams_by_path)

    def device_slots(self) -> tuple[int, int]:
        """(contexts the runners hold resident at once, resident bytes of each slot) summed over runners."""
        caps = [e.runner.capacity() for e in self.engines]
        return sum(n for n, _ in caps), max((b for _, b in caps), default=0)

    def offload_hits(self) -> tuple[int, int]:
        """(selected keys read from the offload runner's GPU caches, selected keys) since start."""
        counts = [e.runner.offload_hits() for e in self.engines]
        return sum(h for h, _ in counts), sum(s for _, s in counts)

    def offload_pcie(self) -> tuple[int, int]:
        """(bytes over PCIe, steps) of the offload runner's decode steps since start (0, 0 without one)."""
        counts = [e.runner.pcie_bytes() for e in self.engines if hasattr(e.runner, "pcie_bytes")]
        return sum(b for b, _ in counts), sum(s for _, s in counts)

    def offload_hit_rate(self) -> float:
        hits, selected = self.offload_hits()
        return hits / selected if selected else 0.0

    def shutdown(self, reason: str) -> None:
        """Live streams end at their next check with UNAVAILABLE(reason); new ones are refused."""
        self._closing_reason = reason
        self._closing.set()

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def _config(self, schedule: str) -> SparseConfig:
        try:
            return SparseConfig.from_schedule(schedule or self.default_schedule)
        except ValueError as exc:
            raise InvalidArgument("schedule", str(exc)) from exc

    def _moded(self, config: SparseConfig, art: ContextArtifact) -> SparseConfig:
        """The stream's config in the decode mode (auto: picked for this device and context)."""
        if resolve(self.decode_mode, self.device_type, art.n_tokens) == "sparse":
            return config
        return replace(config, dense_layers=tuple(range(self.lm.args.n_layers)))

    def _slot_room(self, art: ContextArtifact, config: SparseConfig, prompt: int) -> int:
        """Tokens a stream may generate in the GPU runner that serves this context (a context
        longer than its slots never goes silently to the reference path, which decodes at a
        fraction of its speed): the larger room of the fast runner's slot and the offload
        runner's host slot where both take it; unbounded where no slot-sized runner serves it."""
        runners = [e.runner for e in self.engines]
        off = next((r for r in runners if r.name == "gpu-offload"), None)
        off_room = (min(off.max_len - art.n_tokens - prompt, off.max_new - prompt)
                    if off is not None and off.accepts(art, config, prompt + 1) else 0)
        for r in runners:
            if hasattr(r, "serves") and r.serves(art, config, prompt + 1):
                room = r.cache.max_len - art.n_tokens - prompt
                if room < 1 and off_room < 1:
                    more = (f"--offload-slot-tokens (host slots of {off.max_len})" if off is not None
                            else "--offload")
                    raise FailedPrecondition(
                        f"a context of {art.n_tokens} tokens and a question of {prompt} do not fit this server's "
                        f"GPU slots of {r.cache.max_len} tokens: start it with a larger --gpu-slot-tokens, or "
                        f"with {more}")
                # the slot's index overlay holds max_new new keys
                return max(min(room, r.max_new - prompt), off_room)
        return off_room if off_room > 0 else 1 << 62

    def _engine(self, art: ContextArtifact, config: SparseConfig, new_tokens: int, context_id: str = "") -> Engine:
        """The first engine whose runner takes the stream; where that is the fast runner and the
        offload runner takes it too, the placement picks (offloaded when every HBM slot is busy)."""
        fits = [e for e in self.engines if e.runner.accepts(art, config, new_tokens)]
        if not fits:
            raise ResourceExhausted(f"no decode runner can hold a context of {art.n_tokens} tokens "
                                    f"plus {new_tokens} new ones")
        off = next((e for e in fits[1:] if e.runner.name == "gpu-offload"), None)
        if off is None or not hasattr(fits[0].runner, "serves"):
            return fits[0]
        host = _held(off.runner)
        if self.placement.choose(context_id, _held(fits[0].runner), host) == OFFLOADED:
            return off
        if any(s.context_id == context_id and not s.busy for s in host):  # promoted: held one way
            off.runner.evict(context_id)
            self.metrics.offload_promotions.inc()
            with self._lock:
                self.promotions += 1
        return fits[0]

    def held_contexts(self) -> tuple[int, int]:
        """(contexts held in the fast runners' HBM slots, in the offload runner's host slots)."""
        runners = [e.runner for e in self.engines]
        return (sum(len(_contexts(r)) for r in runners if hasattr(r, "serves")),
                sum(len(_contexts(r)) for r in runners if r.name == "gpu-offload"))

    def _run(self, spec: GenerateSpec, alive: Callable[[], bool], deadline: float | None,
             t0: float, context: CachedContext | None) -> Iterator[Chunk | Final]:
        config = self._config(spec.schedule)
        if spec.context_id == MISS:  # no cached context: all dense, as any server decodes
            config = replace(config, dense_layers=tuple(range(self.lm.args.n_layers)))
        else:
            self.placement.used(spec.context_id)
        head = None if context is not None else self._resident(spec.context_id)
        try:
            seq, art, prompt, sampling, loaded = self._start(spec, config, head, alive, deadline, context)
        except ContextNotResident:  # its slot went to another context since: load it as any other
            seq, art, prompt, sampling, loaded = self._start(spec, config, None, alive, deadline, context)
        self.metrics.decode_paths.labels(seq.path).inc()
        with self._lock:
            self.streams_by_path[seq.path] += 1
        text, n, reason, t_first = TextStream(self.prompter.tokenizer, spec.stop), 0, "length", 0.0
        for tid, cache_full in seq.tokens(lambda: _check(alive, deadline)):
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if tid in sampling.stop_token_ids:
                reason = "stop"
                break
            piece = text.push(tid)
            yield Chunk(piece, (tid,))
            if text.stopped:
                reason = "stop_sequence"
                break
            if cache_full:
                reason = "context_limit"
                break
            _check(alive, deadline)
        else:
            if sampling.max_tokens < spec.sampling.max_tokens:
                reason = "context_limit"
        tail = text.flush()
        if tail:
            yield Chunk(tail, ())
        yield self._final(text, reason, art, prompt, n, t0, t_first, loaded, seq.path)

    def _resident(self, context_id: str) -> Loaded[CachedContext] | None:
        """A context held in a GPU slot starts from the slot's head: no DRAM tier, no disk."""
        roles = self._roles.get(context_id)
        for engine in self.engines if roles is not None else ():
            head = getattr(engine.runner, "resident_head", lambda _: None)(context_id)
            if head is not None:
                return Loaded(CachedContext(head, roles, 0), True, 0.0)
        return None

    def _acquire(self, context_id: str) -> Loaded[CachedContext]:
        loaded = self.cache.acquire(context_id)  # NOT_FOUND / DATA_LOSS before any token
        landing = loaded.value.artifact.landing
        if landing is not None:  # still arriving: a failed download leaves DRAM (its waits raise)
            landing.on_fail(lambda _: self.cache.evict(context_id))
        self.metrics.cache_lookups.labels("hit" if loaded.hit else "miss").inc()
        if not loaded.hit:
            self.metrics.bytes_loaded.inc(loaded.value.stored_bytes)
            if landing is None:  # a landing load's time is known at its end (_load_seconds)
                self.metrics.load_seconds.observe(loaded.load_seconds)
        self._remember_roles(context_id, loaded.value.roles)
        return loaded

    def _remember_roles(self, context_id: str, roles: tuple[str, ...]) -> None:
        with self._lock:
            self._roles[context_id] = roles
            self._roles.move_to_end(context_id)
            while len(self._roles) > _ROLES_KEPT:
                self._roles.popitem(last=False)

    def _start(self, spec: GenerateSpec, config: SparseConfig, head: Loaded[CachedContext] | None,
               alive: Callable[[], bool], deadline: float | None, given: CachedContext | None) -> tuple:
        """-> (sequence, artifact, prompt tokens, sampling, loaded) of a started stream; from
        the resident head if given (ContextNotResident when that runner no longer holds it), else
        from `given` (a build's artifact), else from the DRAM cache."""
        miss = spec.context_id == MISS
        loaded = head or (self._empty if miss else Loaded(given, False, 0.0) if given is not None
                          else self._acquire(spec.context_id))
        ctx, art = loaded.value, loaded.value.artifact
        config = self._moded(config, art)
        placeholder = [{"role": r, "content": "x"} for r in ctx.roles]
        prompt = list(spec.prompt_tokens) or self.prompter.turn_tokens(placeholder, spec.turn)
        room = self.lm.args.max_seq_len - art.n_tokens - len(prompt)
        if room < 1:
            raise InvalidArgument("question", f"{len(prompt)} new tokens after {art.n_tokens} cached "
                                  f"exceed the model's maximum length {self.lm.args.max_seq_len}")
        if spec.strict_window and spec.sampling.max_tokens > room:
            raise InvalidArgument("sampling.max_tokens", f"{spec.sampling.max_tokens} new tokens after a prompt of "
                                  f"{art.n_tokens + len(prompt)} tokens exceed the model's maximum length "
                                  f"{self.lm.args.max_seq_len}: at most {room} fit")
        if not miss:  # a GPU slot's room binds what decodes in the slot; a miss decodes outside
            room = min(room, self._slot_room(art, config, len(prompt)))
        sampling = replace(spec.sampling, max_tokens=min(spec.sampling.max_tokens, room),
                           stop_token_ids=self.prompter.stop_token_ids)
        _check(alive, deadline)
        # a miss has no context to keep in a slot: the reference runner (last) takes every prompt
        engine = (self.engines[-1] if miss
                  else self._engine(art, config, len(prompt) + sampling.max_tokens, spec.context_id))
        if head is not None and not hasattr(engine.runner, "resident_head"):
            raise ContextNotResident(spec.context_id)  # only a slot runner takes a head
        if not getattr(engine.runner, "takes_landing", False):
            wait_landed(art)  # only a slot loader reads an artifact a layer at a time as it lands
        seq = engine.start(spec.context_id, art, prompt, config, sampling, lambda: _check(alive, deadline))
        seq.path = decode_path(seq.path, len(config.dense_layers) == self.lm.args.n_layers)
        if head is not None:
            self.metrics.cache_lookups.labels("hit").inc()
        return seq, art, prompt, sampling, loaded

    def _final(self, text: TextStream, reason: str, art: ContextArtifact, prompt: list[int], n: int,
               t0: float, t_first: float, loaded, path: str) -> Final:
        now = time.perf_counter()
        ttft = (t_first or now) - t0
        tps = (n - 1) / (now - t_first) if n > 1 and now > t_first else 0.0
        self.metrics.ttft.observe(ttft)
        self.metrics.generated_tokens.inc(n)
        if tps:
            self.metrics.tokens_per_second.observe(tps)
        full = text.tokenizer.decode(text.ids, skip_special_tokens=True)
        return Final(full[:text.emitted] if text.stopped else full, reason, art.n_tokens, len(prompt), n,
                     ttft, tps, self._load_seconds(loaded), now - t0, loaded.hit, path)

    def _load_seconds(self, loaded: Loaded[CachedContext]) -> float:
        """The store -> DRAM time: for a download handed over as it landed, up to its hand-over
        plus the landing (ended by the first token: the slot load waits for it)."""
        landing = loaded.value.artifact.landing
        if loaded.hit or landing is None or landing.seconds is None:
            return loaded.load_seconds
        total = loaded.load_seconds + landing.seconds
        self.metrics.load_seconds.observe(total)
        return total


def _check(alive: Callable[[], bool], deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded("deadline exceeded while decoding")
    if not alive():
        raise Cancelled("the client cancelled the stream")


def _held(runner: Runner) -> list[HeldSlot]:
    """The runner's slots as placement sees them (read without its lock: a slot taken meanwhile
    makes the stream wait for one, as before placement)."""
    return [HeldSlot(s.context_id, s.busy, s.last_used) for s in runner.slots]


def _contexts(runner: Runner) -> set[str]:
    return {s.context_id for s in runner.slots if s.context_id is not None}
