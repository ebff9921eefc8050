"""AdminService: evict, rebuild (from stored K/V), verify, stats, describe, reconcile."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ctxcache.decoder.decode_mode import describe
from ctxcache.methods import make_method
from ctxcache.service import convert
from ctxcache.indexer.job_spec import ROLES_LABEL, PutSpec, Reindex
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.errors import FailedPrecondition, InvalidArgument, NotFound
from ctxcache.service.rpc.calls import in_thread, unary
from ctxcache.client.gen.v1 import admin_pb2 as apb, admin_pb2_grpc
from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.service.rpc.servicer import context_info, wait_for
from ctxcache.service.footprint import codec_footprint, stored_bytes_by_part
from ctxcache.store import CorruptArtifact
from ctxcache.store.layout import QUERY_CHUNK


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, indexer: BuildQueue, decoder: GenerateStreams, pool: ThreadPoolExecutor) -> None:
        self.indexer, self.decoder, self.backend, self.pool = indexer, decoder, indexer.backend, pool

    @unary
    async def Evict(self, request, context):
        if request.memory_only + request.device_only + request.local_only > 1:
            raise InvalidArgument("device_only", "set at most one of memory_only, device_only and local_only")
        return await in_thread(self.pool, self._evict, convert.context_id(request.context_id), request.memory_only,
                               request.device_only, request.local_only)

    def _evict(self, cid: str, memory_only: bool, device_only: bool, local_only: bool = False) -> apb.EvictResponse:
        if device_only:
            return apb.EvictResponse(evicted=self.decoder.evict_device(cid))
        if local_only:  # the object store's copy stays: the next Generate loads from it
            freed = self.decoder.evict(cid)
            return apb.EvictResponse(evicted=self.backend.drop_local(cid) or freed > 0, bytes_freed=freed)
        if memory_only:
            freed = self.decoder.evict(cid)
            return apb.EvictResponse(evicted=freed > 0, bytes_freed=freed)
        cancelled = self.indexer.cancel(cid, "evicted")  # a BUILDING id stops building
        try:
            m = self.backend.manifest(cid)
        except CorruptArtifact:  # a damaged context is evicted as any other (its bytes unknown)
            m = None
        deleted = self.backend.delete(cid)  # store first: a load racing this is then not cached
        freed = self.decoder.evict(cid)
        return apb.EvictResponse(evicted=deleted or cancelled or freed > 0,
                                 bytes_freed=(m.stored_bytes if m and deleted else 0) + freed)

    @unary
    async def Rebuild(self, request, context):
        new_id, job, reprefill = await in_thread(self.pool, self._rebuild, request)
        if request.wait:
            await wait_for(job)
        info = await in_thread(self.pool, context_info, self.indexer, new_id)
        return apb.RebuildResponse(context=info, reprefilled=reprefill)

    def _rebuild(self, request):
        cid = convert.context_id(request.context_id)
        m = self.backend.manifest(cid)
        if m is None:
            raise NotFound(f"context {cid} not found")
        name, params = convert.method_spec(request.method, m.method, m.method_params if not request.method.name else {})
        # its own method converts the stored state (an old format's derived rows dropped) from
        # the stored K/V alone; another query-built method needs the prefill queries
        converts = name == m.method and make_method(name, params).params == make_method(m.method, m.method_params).params
        needs_queries = make_method(name, params).caps.uses_queries and not converts
        has_queries = any(c.name == QUERY_CHUNK for c in m.chunks)
        reprefill = needs_queries and not has_queries
        if reprefill and not request.allow_reprefill:
            raise FailedPrecondition(f"method {name!r} builds from the prefill queries, which this "
                                     "artifact did not store (PutContext keeps them only with keep_queries); "
                                     "set allow_reprefill (CLI: `ctxcache admin rebuild --allow-reprefill`) to re-prefill the "
                                     "stored tokens")
        art = self.backend.get(cid, with_queries=needs_queries)
        if art is None:
            raise NotFound(f"context {cid} not found")
        roles = m.labels.get(ROLES_LABEL, "system").split(",")
        labels = {k: v for k, v in m.labels.items() if not k.startswith(convert.RESERVED_LABEL)}
        spec = PutSpec([{"role": r, "content": ""} for r in roles], labels, m.ttl_s, m.pinned, name,
                       params, request.wait, m.tenant, m.kv_codec, has_queries)
        source = None if reprefill else Reindex(cid, needs_queries, art)  # a decoder's indexer loads it by id
        new_id, job, _ = self.indexer.submit(spec, art.tokens.tolist(), source)
        return new_id, job, reprefill

    @unary
    async def Verify(self, request, context):
        return await in_thread(self.pool, self._verify, request)

    def _verify(self, request) -> apb.VerifyResponse:
        ids = [convert.context_id(request.context_id)] if request.context_id else self.backend.context_ids()
        results = []
        for cid in ids:
            report = self.backend.verify(cid)
            if request.context_id and not report.found:
                raise NotFound(f"context {cid} not found")
            problems = [f"{b.chunk}: {b.reason}" for b in report.bad]
            # repair: the fleet's registry knows it DAMAGED, so a Put of its content rebuilds it
            marked = request.repair and not report.ok and self.backend.mark_damaged(cid, "; ".join(problems)[:500])
            results.append(apb.VerifyResult(context_id=cid, ok=report.ok, problems=problems, marked_damaged=marked))
        return apb.VerifyResponse(results=results)

    @unary
    async def Stats(self, request, context):
        return await in_thread(self.pool, self._stats)

    def _stats(self) -> apb.StatsResponse:
        st = self.backend.stats()
        building, failed = self.indexer.counts()
        steps, rows = self.decoder.decode_counts()
        slots, slot_bytes = self.decoder.device_slots()
        hits, selected = self.decoder.offload_hits()
        resident, offloaded = self.decoder.held_contexts()
        pcie, offload_steps = self.decoder.offload_pcie()
        return apb.StatsResponse(
            contexts_ready=st.contexts, contexts_building=building, contexts_failed=failed,
            store_bytes=st.stored_bytes, store_budget_bytes=st.budget_bytes,
            dram_cache_bytes=self.decoder.cache.bytes, dram_cache_entries=len(self.decoder.cache),
            active_streams=self.decoder.active, build_queue=self.indexer.queued(),
            registry=self.backend.registry_kind, registry_available=self.backend.registry_available(),
            model_id=self.indexer.lm.model_id,
            footprint=codec_footprint(self.backend.store.list_manifests(limit=1 << 31)),
            decode_steps=steps, decode_rows=rows, device_slots=slots, device_slot_bytes=slot_bytes,
            offload_cache_hits=hits, offload_selected_keys=selected,
            resident_contexts=resident, offloaded_contexts=offloaded,
            offload_hit_rate=hits / selected if selected else 0.0, offload_promotions=self.decoder.promotions,
            offload_pcie_bytes=pcie, offload_steps=offload_steps,
            decode_mode=describe(self.decoder.decode_mode, self.decoder.device_type),
            streams_by_decode_path=self.decoder.decode_streams())

    @unary
    async def Describe(self, request, context):
        return await in_thread(self.pool, self._describe, convert.context_id(request.context_id))

    def _describe(self, cid: str) -> apb.DescribeResponse:
        info = context_info(self.indexer, cid)  # NotFound for an unknown id
        m = self.backend.manifest(cid)  # None while building: nothing stored yet
        return apb.DescribeResponse(context=info, stored_bytes_by_part=stored_bytes_by_part(m) if m else {})

    @unary
    async def Reconcile(self, request, context):
        registered, removed, damaged = await in_thread(self.pool, self.backend.reconcile)
        return apb.ReconcileResponse(registered=registered, removed=removed, damaged=damaged)
