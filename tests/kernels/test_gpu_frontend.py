"""The front-end check (tests/gpu_frontend.py, run on every session's launches by tests/conftest.py)
catches what the interpreter accepts and the GPU compiler rejects."""

import torch
import triton
import triton.language as tl

from gpu_frontend import launch_record, frontend_errors


@triton.jit
def _rows(ptr, offs, mask, CODES: tl.constexpr):  # the helper's shape that failed on the H200
    if CODES:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.bfloat16)
    return tl.load(ptr + offs, mask=mask, other=0)


@triton.jit
def _rows_once(ptr, offs, mask, CODES: tl.constexpr):  # the fix: one return
    if CODES:
        v = tl.load(ptr + offs, mask=mask, other=0).to(tl.bfloat16)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0)
    return v


@triton.jit
def _copy(src, dst, n, CODES: tl.constexpr, ONCE: tl.constexpr):
    offs = tl.arange(0, 16)
    if ONCE:
        v = _rows_once(src, offs, offs < n, CODES)
    else:
        v = _rows(src, offs, offs < n, CODES)
    tl.store(dst + offs, v, mask=offs < n)


def _launch(once: bool, codes: bool) -> dict:
    src = torch.zeros(16, dtype=torch.int8 if codes else torch.bfloat16)
    return launch_record(_copy.fn, (src, torch.zeros(16, dtype=torch.bfloat16), 16), {"CODES": codes, "ONCE": once})


def test_a_discarded_branchs_return_of_another_type_is_reported_and_one_return_builds():
    errors = frontend_errors([_launch(False, True), _launch(True, True), _launch(True, False)])
    assert len(errors) == 1 and "Inconsistent return types" in errors[0], errors
    assert errors[0].startswith("_copy {'CODES': True, 'ONCE': False}")
