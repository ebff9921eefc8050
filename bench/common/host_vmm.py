"""Host memory from the CUDA driver's virtual memory API (cuMemCreate on a host NUMA node, mapped
into the device's address space), for `bench host_gather`.

Why: scattered zero-copy reads of page-locked host memory slow with the memory they are spread
over (H200: 399 M rows/s over 0.25 GiB, 48 M over 4 GiB), the same for cudaHostRegister'd pages,
cudaHostAlloc and THP-backed pages: translations, not bytes. The driver maps such an allocation
in its own granularity (typically 2 MiB), so if the device's page tables follow it, the same
reads need 512x fewer translations. ctypes over libcuda: no extra package on the GPU machine.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

_PINNED, _HOST_NUMA, _DEVICE, _READWRITE = 1, 3, 1, 3  # CUmemAllocationType, CUmemLocationType, CUmemAccess_flags


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _DeviceArray:
    """A raw device address as torch sees CUDA memory (__cuda_array_interface__)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def _check(lib: ctypes.CDLL, name: str, *args) -> None:
    err = getattr(lib, name)(*args)
    if err != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(text))
        raise RuntimeError(f"{name}: {text.value.decode() if text.value else err}")


def host_numa_tensor(nbytes: int, numa_node: int = 0) -> tuple[torch.Tensor, int]:
    """(uint8 tensor of >= nbytes on the device's side, physically host memory of `numa_node`;
    the allocation's granularity in bytes). Freed with the tensor."""
    lib = ctypes.CDLL("libcuda.so.1")
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    dev = torch.cuda.current_device()
    prop = _Prop(type=_PINNED, location=_Location(_HOST_NUMA, numa_node))
    gran = ctypes.c_size_t()
    _check(lib, "cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), ctypes.c_int(1))
    size = -(-nbytes // gran.value) * gran.value
    handle, ptr = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    _check(lib, "cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    _check(lib, "cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(gran.value),
           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    _check(lib, "cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
    access = _AccessDesc(_Location(_DEVICE, dev), _READWRITE)
    _check(lib, "cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
    owner = _DeviceArray(ptr.value, size)

    def free(lib=lib, ptr=ptr.value, size=size, handle=handle.value) -> None:
        torch.cuda.synchronize()
        lib.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
        lib.cuMemAddressFree(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
        lib.cuMemRelease(ctypes.c_ulonglong(handle))
    # torch holds the interface's owner as long as any view of the memory lives
    weakref.finalize(owner, free)
    return torch.as_tensor(owner, device="cuda"), gran.value
