"""A program's 256-bin histogram by shared-memory atomics (inline PTX), for radix pass 0.

Why: `tl.histogram` lowers to a warp ballot per bin bit plus, per lane, a mask combine and popc
for each of its 8 owned bins: ~56 instructions per key at 256 bins. In the int8 score kernel
(dense_dot8) that made the histogram ~27 us of a ~69 us launch at 128K batch 8 (H100, bench
step_probe --sweeps score at d74d176: 41.6 us without pass 0). One `red.shared.add` per key (sm_90
compiles it to a warp-aggregated ATOMS.POPC.INC) does the same work.

Triton exposes no shared-memory atomics, so the histogram lives in a `.shared` array declared
by inline PTX (function scope, 1 KB beside Triton's own dynamic shared memory). Every thread
adds each element it holds. A Triton layout may hold an element in several threads (a reduced
or broadcast tensor); its own ops de-duplicate, inline PTX cannot, so every element also adds
to a total: total = BLOCK x replication, and each bin is divided by the replication. Triton
then adds the bins to global memory with `tl.atomic_add`, which de-duplicates itself.

The CPU interpreter cannot run PTX: there the caller uses `tl.histogram` (same counts)."""

from __future__ import annotations

import triton
import triton.language as tl

_SLOTS = tl.constexpr(260)  # 256 bins, the total (256) and a bin for masked-out keys (257)

_DECLARE = tl.constexpr(""".shared .align 16 .b32 ctxcache_hist0[260];
mov.u32 $0, 0;""")

_ZERO = tl.constexpr("""{
.reg .b32 a;
.reg .pred p;
setp.lt.u32 p, $1, 260;
mov.u32 a, ctxcache_hist0;
mad.lo.u32 a, $1, 4, a;
@p st.shared.u32 [a], 0;
mov.u32 $0, 0;
}""")

_BARRIER = tl.constexpr("""bar.sync 0;
mov.u32 $0, 0;""")

_ADD = tl.constexpr("""{
.reg .b32 a, t;
mov.u32 t, ctxcache_hist0;
mad.lo.u32 a, $1, 4, t;
red.shared.add.u32 [a], 1;
red.shared.add.u32 [t+1024], 1;
mov.u32 $0, 0;
}""")

_READ = tl.constexpr("""{
.reg .b32 a;
mov.u32 a, ctxcache_hist0;
mad.lo.u32 a, $1, 4, a;
ld.shared.u32 $0, [a];
}""")


@triton.jit
def _asm(code: tl.constexpr, x):
    return tl.inline_asm_elementwise(code, "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def smem_hist_add(digit, valid, hist_ptr, BLOCK: tl.constexpr):
    """Add the 256-bin histogram of digit [BLOCK] (int32 in [0, 256)) where valid to the int32
    counts at hist_ptr (global atomics, empty bins skipped). Compiled GPU code only; every
    thread of the program must call it (it synchronizes the program)."""
    pid = tl.program_id(0)
    # inline PTX with side effects keeps its program order (declare, zero, barrier, add,
    # barrier, read); adding each step's zero output to the next step's input also makes it
    # depend on it by data
    dec = _asm(_DECLARE, pid)  # a scalar: emitted once per thread, so declared once
    _asm(_ZERO, tl.arange(0, 512) + dec)
    b0 = _asm(_BARRIER, pid)
    _asm(_ADD, tl.where(valid, digit, 257) + b0)
    b1 = _asm(_BARRIER, pid)
    bins = tl.arange(0, 256)
    count = _asm(_READ, bins + b1)
    total = _asm(_READ, b1 + 256)
    count = count // (total // BLOCK)  # each element was added once per thread holding it
    tl.atomic_add(hist_ptr + bins, count, mask=count > 0, sem="relaxed")
