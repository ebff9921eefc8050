"""Triton kernels for the GPU decode fast path (CSAttention selection and sparse attention).

Each module holds a torch reference (`*_ref`), the private Triton kernel and a launcher that
checks shapes and strides. All run on CPU under TRITON_INTERPRET=1 (tests/kernels/)."""

from ctxcache.kernels._interp import patch_interpreter

patch_interpreter()
