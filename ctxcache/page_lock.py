"""Page-locking a host mapping for CUDA, exactly its size: what host_pool's one pool and
host_copy's exact pinned tensors (and store/arena's mappings) are made of. Its own module so
that host_pool and host_copy do not import each other."""

from __future__ import annotations

import ctypes
import mmap
import weakref

import torch

# cudaHostRegisterPortable | cudaHostRegisterMapped: every context may copy from it, and kernels
# may address it (the offload runner's K/V are read and written by kernels in place)
_REGISTER_FLAGS = 1 | 2


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
