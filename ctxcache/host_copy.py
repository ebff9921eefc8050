"""Device -> host copies for artifacts built on a GPU.

A pageable device-to-host copy ran at about 1.5 GB/s on the H100 (83% of PutContext's index
time at 8K tokens); into pinned memory it runs at PCIe speed and asynchronously, so the build
queues every copy and waits once (`wait_for_host_copies`) before the artifact is read.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref

import torch

# cudaHostRegisterPortable | cudaHostRegisterMapped: every context may copy from it, and kernels
# may address it (the offload runner's K/V are read and written by kernels in place)
_REGISTER_FLAGS = 1 | 2


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (cast to `dtype` first, on its device) on the host: pinned and not yet waited for
    when `t` is on a GPU; a plain CPU tensor otherwise."""
    if dtype is not None:
        t = t.to(dtype)
    if not t.is_cuda:
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def wait_for_host_copies(device: torch.device) -> None:
    """Every copy `to_host` queued on `device`'s current stream has landed."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def page_lock(buf: mmap.mmap) -> ctypes.Array:
    """The whole mapping as a ctypes array, page-locked for CUDA (cudaHostRegister, exactly its
    size) until the array, and so every tensor made from it, is gone; the array holds the
    mapping open, so the unregister runs while the pages are still mapped.
    Why not `torch.empty(pin_memory=True)`: torch's host caching allocator rounds each pinned
    block up to a power of two and keeps freed blocks for reuse, so a 2.2 GB artifact pinned
    4 GB, and on the H100 the 12th 32K load of a DRAM tier failed with CUDA out of memory
    (SGLang's host caches moved to mmap + cudaHostRegister for the same reason)."""
    view = (ctypes.c_ubyte * len(buf)).from_buffer(buf)
    address = ctypes.addressof(view)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, len(buf), _REGISTER_FLAGS)
    if int(err) != 0:
        raise MemoryError(f"cannot page-lock {len(buf) / 2**30:.2f} GiB of host memory (cudaHostRegister: "
                          f"{cudart.cudaGetErrorString(err)})")
    weakref.finalize(view, cudart.cudaHostUnregister, address)
    return view


def pinned_exact(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor page-locked for exactly its bytes where CUDA is (see page_lock); a
    plain CPU tensor elsewhere."""
    if not torch.cuda.is_available():
        return torch.zeros(shape, dtype=dtype)
    n = math.prod(shape)
    buf = mmap.mmap(-1, max(n * torch.empty(0, dtype=dtype).element_size(), 1),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # anonymous pages are zero
    return torch.frombuffer(page_lock(buf), dtype=dtype, count=n).view(shape)


class HostSlab:
    """Host tensors of shapes known ahead (a build's K/V parts, per layer), carved from one
    buffer page-locked for exactly their bytes (pinned_exact) on a thread: a build starts it
    before its prefill, so the page-locking overlaps the GPU work instead of following it.
    Why not to_host's torch.empty(pin_memory=True) per part: each cold block is a
    cudaHostAlloc on the build's own thread after the prefill, rounded up to a power of two
    (the 127K K/V, 8.5 GB, pinned 17 GB) and kept by torch's cache after the artifact is gone.
    Off a GPU it is plain memory, so the same code runs in CPU builds."""

    ALIGN = 64  # bytes: every part starts aligned for any dtype's view

    def __init__(self, layers: list[dict[str, tuple[tuple[int, ...], torch.dtype]]]) -> None:
        self._specs, self._offsets, total = layers, [], 0
        for layer in layers:
            at = {}
            for name, (shape, dtype) in layer.items():
                at[name] = total
                total += -(-math.prod(shape) * torch.empty(0, dtype=dtype).element_size() // self.ALIGN) * self.ALIGN
            self._offsets.append(at)
        self.nbytes = total
        self._buf: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._allocate, name="host-slab", daemon=True)
        self._thread.start()

    def _allocate(self) -> None:
        try:
            self._buf = pinned_exact((max(self.nbytes, 1),), torch.uint8)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by layers()
            self._error = exc

    def layers(self) -> list[dict[str, torch.Tensor]]:
        """Each layer's tensors (waits for the buffer; raises what allocating it raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        out = []
        for layer, at in zip(self._specs, self._offsets):
            views = {}
            for name, (shape, dtype) in layer.items():
                size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                views[name] = self._buf[at[name]:at[name] + size].view(dtype).view(shape)
            out.append(views)
        return out
