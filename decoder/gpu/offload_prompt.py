"""Which run an offloaded row's question prefill takes (`prompt_run`): eager with its host V
copied serially on the compute stream (the default), eager with it copied a layer ahead on a copy
lane (pipelined_prefill: offload_prefill.PrefillFetch), or, with OffloadRunner(prefill_graphs=True)
and the serial copy, replayed as CUDA graphs, as a resident slot's is (prefill_graph.py).

Why: a hot admission of a 20-token question on an offloaded 32K context (H200, random
Llama-3.1-8B bf16, V as int8 codes read zero-copy) took 56.9 ms eagerly while the device was busy
~33 ms: each layer's copy and kernels start the moment the host issues them, at ~1.8 ms of
Python a layer. A replay issues a layer's launches at once.

Why it replays: the serial prefill of T tokens (the prompt padded to slot_prefill.PAD_TO, its
real length a device input) into host row r after a context of n tokens is one kernel sequence
at fixed addresses whatever the values: the row's pinned host slot (V, or V's int8 codes, which
one dequant launch a layer reads where they are, decoding to the row's `v_kind`: a compile-time
constant of the kernel), its K buffer and HBM tail, its table views (`_row_tables`), and
positions, spans and index columns set by (r, n, T). So a key is (r, n, T, v_kind); copies
between pinned host memory and the device are capturable, and nothing on the path reads the
device on the host (the prompt's first position is the view's `prompt_start`).

The padding leaves no trace a decode step reads, as the resident path's: its slots follow every
real token (causal attention keeps them out of the real queries' outputs), its keys are not
indexed (insert_span counts the real ones) nor seeded from (SeedPadding.of), its logits are not
taken (`last`); its K and V land past the row's length (the K buffer, the host slot or the HBM
tail), where each decode step writes its own key before any step reads that position; the row's
length, device length and streamed-key count (the runner's settler) and its slot caches (emptied
before its first step) come from the real length on the host.

The pipelined copy lane (offload_prefill.PrefillFetch: two streams and events) stays eager and
unpadded; so does every prefill with graphs off (the default until measured on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from ctxcache.decoder.gpu.offload_prefill import HostPrefillAttention, PrefillFetch
from ctxcache.decoder.gpu.prefill_graph import Capturing, Key, Replay
from ctxcache.decoder.gpu.slot_prefill import padded_length, prompt_input
from ctxcache.generation import LayeredPrefill
from ctxcache.kernels.v_codes import decode_v_into

if TYPE_CHECKING:
    from ctxcache.decoder.gpu.offload_runner import HostSlot, OffloadRunner


def graphs_on(runner: OffloadRunner) -> bool:
    """Whether the runner's next prompt prefill goes through its PrefillGraphs (padded)."""
    return runner.prefill_graphs is not None and not runner.pipelined_prefill


def padded(runner: OffloadRunner, n_ctx: int, tokens: int) -> int:
    """A prompt's length padded to a multiple of PAD_TO where the row (its slot, the HBM tail of
    max_new + 1 positions, the index overlay) has room, else its own."""
    room = min(runner.max_len, runner.lm.args.max_seq_len) - n_ctx
    return padded_length(tokens, min(room, runner.max_new - 1))


def key_of(slot: HostSlot, padded_tokens: int) -> Key:
    """What fixes a serial prefill's kernels and addresses (module docstring)."""
    return slot.index, slot.n_ctx, padded_tokens, slot.v_kind


def maker(runner: OffloadRunner, row: int, n_ctx: int, v_kind: int) -> Callable[[torch.Tensor], LayeredPrefill]:
    """A serial prefill of inputs [1, T + 1] (slot_prefill.prompt_input: T padded prompt tokens
    and the real count) into host row `row` after n_ctx tokens, for the engine or for a graph
    capture (which records it: the row's contents do not matter then)."""
    tables = runner._row_tables(row)  # here, not in make: its seed buffers exist before any capture
    kind = v_kind if runner.v_int8 else None

    def make(inputs: torch.Tensor) -> LayeredPrefill:
        view = runner.kv.rows(row, row + 1, prompt_start=n_ctx)
        attn = HostPrefillAttention(tables, runner._perm, runner.config.budget, bool(runner.follow),
                                    runner.config.dense_layers, n_ctx, None, kind, real=inputs[0, -1:].int())
        return LayeredPrefill(runner.lm.model, inputs[:, :-1], n_ctx, view, attn, last=attn.last)
    return make


def prompt_run(runner: OffloadRunner, slot: HostSlot, prompt: list[int], loaded: bool
               ) -> tuple[Replay | Capturing | LayeredPrefill, PrefillFetch | None, int]:
    """The row's prompt prefill at its first layer; -> (it, the copy lane's fetch, the positions
    it spans). With graphs (graphs_on): padded, and replayed, captured as it runs (the key's
    second use, or its first where the admission `loaded` the row: the load dwarfs the capture),
    or eager. Else unpadded, eager; pipelined: its host V's (K's too without k_hbm) first two
    layers already queued on the copy lane."""
    if graphs_on(runner):
        tokens = padded(runner, slot.n_ctx, len(prompt))
        make = maker(runner, slot.index, slot.n_ctx, slot.v_kind)
        inputs = prompt_input(prompt, tokens, runner.device)
        run = runner.prefill_graphs.prefill(key_of(slot, tokens), inputs, runner.lm.args.n_layers, make,
                                            first_use=loaded)
        return run or make(inputs), None, slot.n_ctx + tokens
    row, span = slot.index, slot.n_ctx + len(prompt)
    view = runner.kv.rows(row, row + 1, prompt_start=slot.n_ctx)
    fetch = None
    kind = slot.v_kind if runner.v_int8 else None
    if runner.pipelined_prefill:
        if kind is None:
            host, decode = [[v] + ([] if runner.k_hbm else [k]) for k, v in zip(view.k, view.v)], None
        else:  # codes and scales cross, decoded on the device as the layer reads them
            host = [[c, s] for c, s in zip(view.v_codes, view.v_scales)]
            decode = partial(decode_v_into, kind=kind)
        fetch = PrefillFetch(host, slot.n_ctx, span, runner.prefill_lane(), runner.device, decode, view.v[0].dtype)
        view.tap = fetch.write_prompt
    attn = HostPrefillAttention(runner._row_tables(row), runner._perm, runner.config.budget,
                                bool(runner.follow), runner.config.dense_layers, slot.n_ctx, fetch, kind)
    tokens = torch.tensor([prompt], pin_memory=runner.device.type == "cuda")
    run = LayeredPrefill(runner.lm.model, tokens.to(runner.device, non_blocking=True), slot.n_ctx, view, attn)
    return run, fetch, span


def idle_work(runner: OffloadRunner) -> bool:
    """While no stream uses the runner: capture one prefill graph of a key seen once (its next
    admission replays it, even beside decoding streams); -> whether one was captured."""
    with runner.lock, torch.inference_mode():
        if not graphs_on(runner) or any(s.busy for s in runner.slots):
            return False
        return runner.prefill_graphs.capture_seen(lambda key: maker(runner, key[0], key[1], key[3]),
                                                  runner.lm.args.n_layers, runner.device)
