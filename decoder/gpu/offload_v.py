"""Host slots that hold V as the artifact's int8 codes (kv_codec "int8"), and what reads them.

Why (arithmetic, Llama-3.1-8B at 32K, H200): V in bf16 is 256 B a token and KV head; its codes and
scale are 130 B. A hot admission copied 2.2 GB of V (~40 ms of its ~60); a decode step of 8 streams
moved ~550 MB of slot-cache misses; the pool's page-locked bytes bound how many contexts the host
holds. As codes, each is 0.51x, and every reader decodes by the loader's arithmetic (kernels/
v_codes.py: fp32 code x scale, rounded to the artifact's dtype, then the model's), so the values
are the bits a resident slot holds and the logits are those of a bf16 host slot holding them.

Layout (CodedHostKVPool), one layout per runner (OffloadRunner(v_int8=True), the server's choice
when its kv_codec is int8; artifacts not held as int8 codes are refused by `refusal`): per layer
codes [slots, Hkv, max_len, D] int8 in one page-locked allocation, and scales [slots, Hkv, max_len]
fp16 in HBM (2 B a token and head, 1.6% of the codes: a step's miss then reads one aligned 128-B
row over PCIe, not that row and a 2-B scale elsewhere; gathers of scattered rows in HBM cost by
their count, not their bytes, DESIGN.md, and the offload kernel's misses crossed at ~21 GB/s of a
55 GB/s link); `v` is a bf16 tail in HBM [slots, Hkv, tail, D] of the positions from each row's
context length on (its question's and answer's, from the model, never coded), `v_start` [slots]
(int32, device) each row's context length, `v_kind` [slots] each row's artifact's decoded dtype.
K is in HBM (offload_k.k_buffers, `with_k`): int8 V needs `--offload-k hbm`.

Readers: the decode step's attention (kernels.offload_attention with `coded`: the context's
positions decoded from the host codes, the rest from the tail; misses written decoded into the
slot cache), dense layers (`CodedDense`: the same kernel with every position a static row), a
prompt's prefill (`v_to_device`: one dequant launch a layer reading the codes where they are,
pinned, zero-copy, plus the tail's positions; pipelined: offload_prefill.PrefillFetch copies codes
and scales and decodes on the device). Writers: the fused RoPE + write of a decode step (its V at
pos - v_start into the tail, kernels.rope_write) and `write` (a prompt's V into the tail).
"""

from __future__ import annotations

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.gpu.offload_step import HostKVPool
from ctxcache.decoder.gpu.slot_prefill import ResidentHead
from ctxcache.host_copy import pinned_exact
from ctxcache.kernels.v_codes import CodedV, decode_v_into, kind_of
from ctxcache.kv_codec import KEY_GROUP, SCALE_SUFFIX, CodedKV
from ctxcache.models.kv_cache import KVCache


class CodedHostKVPool(HostKVPool):
    """V codes [slots, Hkv, max_len, D] a layer in one page-locked allocation, their scales
    [slots, Hkv, max_len] and the bf16 tail [slots, Hkv, tail, D] a layer in HBM (module docstring).
    `k` is empty until `with_k`."""

    fused_decode_write = True  # rope_write puts V at pos - v_start, in the tail
    fused_prompt_write = False

    def __init__(self, n_layers: int, slots: int, n_kv: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, tail: int) -> None:
        if slots < 1 or max_len < 2 or tail < 1:
            raise ValueError(f"offload slots={slots}, slot tokens={max_len}, tail={tail} must be >= 1, >= 2, >= 1")
        # one registration for every layer's codes: page-locking is paid per call (~0.4 s per GB)
        pool = pinned_exact((n_layers * slots * n_kv * max_len * head_dim,), torch.int8)
        codes = pool.view(n_layers, slots, n_kv, max_len, head_dim)
        scales = torch.zeros(n_layers, slots, n_kv, max_len, dtype=torch.float16, device=device)
        self.k: list[torch.Tensor] = []
        self.v_codes = [codes[i] for i in range(n_layers)]
        self.v_scales = [scales[i] for i in range(n_layers)]
        self.v = [torch.zeros(slots, n_kv, tail, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v_start = torch.zeros(slots, dtype=torch.int32, device=device)
        self.v_kind = torch.zeros(slots, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.nbytes = pool.nbytes  # page-locked bytes (the tail and the scales are HBM)
        self.prompt_start = None

    def coded(self, layer: int) -> CodedV:
        return CodedV(self.v_scales[layer], self.v[layer], self.v_start, self.v_kind)

    def load_v(self, row: int, layer: int, coded: CodedKV) -> None:
        """A layer's V codes into the row's host slot (host to host, not decoded) and their scales
        into HBM, as the artifact holds them."""
        n = coded.shape[1]
        self.v_codes[layer][row, :, :n].copy_(coded.parts["v"])
        self.v_scales[layer][row, :, :n].copy_(coded.parts["v" + SCALE_SUFFIX])

    def set_row(self, row: int, n_ctx: int, decoded: torch.dtype) -> None:
        """After a load: the row's context length (the tail's first position) and decoded dtype,
        as device fills (no host-scalar copy)."""
        self.v_start[row:row + 1].fill_(n_ctx)
        self.v_kind[row:row + 1].fill_(kind_of(decoded))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Rows' keys [B, Hkv, T, D] at consecutive positions pos [B, T]: K into its HBM buffer, V
        into the tail at pos - v_start (a prompt's view: from prompt_start, the context's end, so
        the tail's first position; else read on the host: the CPU path only). Positions outside
        the tail are not written (as rope_write: only a throw-away token can be there)."""
        t, rows = pos.shape[1], pos.shape[0]
        if self.prompt_start is not None:
            starts, bases = [self.prompt_start] * rows, [self.prompt_start] * rows
        else:
            starts, bases = pos[:, 0].tolist(), self.v_start.tolist()
        tail = self.v[layer].shape[2]
        for b, (start, base) in enumerate(zip(starts, bases)):
            self.k[layer][b, :, start:start + t].copy_(k[b], non_blocking=True)
            if 0 <= start - base and start - base + t <= tail:
                self.v[layer][b, :, start - base:start - base + t].copy_(v[b], non_blocking=True)
        if self.tap is not None:
            self.tap(layer, k, v)

    def rows(self, start: int, end: int, prompt_start: int | None = None) -> "CodedHostKVPool":
        view = CodedHostKVPool.__new__(CodedHostKVPool)
        view.k = [k[start:end] for k in self.k]
        view.v = [v[start:end] for v in self.v]
        view.v_codes = [c[start:end] for c in self.v_codes]
        view.v_scales = [s[start:end] for s in self.v_scales]
        view.v_start, view.v_kind = self.v_start[start:end], self.v_kind[start:end]
        view.lengths = self.lengths[start:end]
        view.nbytes = sum(t.nbytes for t in view.k + view.v + view.v_codes + view.v_scales)
        view.prompt_start = prompt_start
        return view

    def with_k(self, k: list[torch.Tensor]) -> "CodedHostKVPool":
        view = self.rows(0, self.v[0].shape[0])
        view.k = list(k)
        view.nbytes += sum(t.nbytes for t in view.k)
        return view


def refusal(art: ContextArtifact) -> str | None:
    """Why an int8-V runner cannot hold this artifact (None: it can): its V must be int8 codes. A
    ResidentHead (a held context's head, no K/V: slot_prefill) of an int8 context passes: a slot
    holds it only after its full artifact did, and a runner not holding it says so at the claim."""
    if isinstance(art, ResidentHead):
        return None if art.kv_codec == "int8" else f"this context's K/V are {art.kv_codec}, not int8 codes"
    if art.layers and all(la.coded is not None and la.coded.codec == "int8" for la in art.layers):
        return None
    return (f"the offload runner's host slots hold V as int8 codes (serve --kv-codec int8); this context's K/V "
            f"are {art.kv_codec} and not held as int8 codes")


def k_into(coded: CodedKV, k_out: torch.Tensor) -> None:
    """A layer's K decoded into k_out [Hkv, N, D] exactly as CodedKV.decode_into decodes it (its
    V not decoded: the host slot keeps V's codes)."""
    if k_out.is_cuda:
        from ctxcache.kernels.load_kernels import dequant_into, dequant_ok
        if dequant_ok(coded.parts["k"], coded.dtype, k_out.dtype):
            p = [t if t.is_cuda or t.is_pinned() else t.to(k_out.device)
                 for t in (coded.parts["k"], coded.parts["k" + SCALE_SUFFIX])]
            dequant_into(p[0], p[1], k_out, KEY_GROUP, coded.dtype)
            return
    k_out.copy_(coded.decode(k_out.device)[0])


def v_to_device(cache: CodedHostKVPool, layer: int, n_ctx: int, span: int, kind: int,
                device: torch.device) -> torch.Tensor:
    """A one-row view's first `span` positions of V [1, Hkv, span, D] on `device`: the context's
    decoded from its codes by one dequant launch that reads them where they are (pinned host
    memory, zero-copy: a launch a layer, where copying each head's codes and scales took 16),
    the prompt's copied from the tail (device to device)."""
    tail = cache.v[layer]
    out = torch.empty((1, tail.shape[1], span, tail.shape[3]), dtype=tail.dtype, device=device)
    decode_v_into(cache.v_codes[layer][0, :, :n_ctx], cache.v_scales[layer][0, :, :n_ctx], out[0, :, :n_ctx], kind)
    out[:, :, n_ctx:span].copy_(tail[:, :, :span - n_ctx])
    return out


class CodedDense:
    """A dense layer's decode over coded V: kernels.offload_attention with every position a
    static row (sinks = the slot length, no selected keys), so the context's V is decoded from
    the host codes and the rest read from the tail; the slot cache is not touched."""

    def __init__(self, batch: int, n_kv: int, max_len: int, device: torch.device) -> None:
        from ctxcache.kernels.split_k_attention import choose_splits
        self.max_len, self.splits = max_len, choose_splits(batch * n_kv, max_len)
        self.none = torch.zeros(batch, n_kv, 1, dtype=torch.int32, device=device)  # idx and slot, never read
        self.k_sel = torch.zeros(batch, dtype=torch.int32, device=device)

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor,
                 n: torch.Tensor | None = None) -> torch.Tensor:
        """As GpuDenseAttention: n, the step's lengths, where the caller has them."""
        from ctxcache.kernels.offload_attention import offload_attention
        if q.shape[2] > 1:
            raise RuntimeError("a prompt's prefill runs through HostPrefillAttention")
        n = (pos[:, 0] + 1).int() if n is None else n
        tail = cache.v[layer]
        out = offload_attention(q[:, :, 0], cache.k[layer], cache.v_codes[layer], None, tail, self.none, self.none,
                                self.k_sel, n, self.max_len, 0, splits=self.splits, coded=cache.coded(layer))
        return out[:, :, None]
