"""CTXCACHE_NO_PDL=1 turns programmatic dependent launch off (bench step_profile --no-pdl)."""

import pytest
import torch

from ctxcache.kernels.sync import pdl_available


@pytest.mark.gpu
def test_no_pdl_turns_it_off_where_the_gpu_has_it(monkeypatch):
    hopper = torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.delenv("CTXCACHE_NO_PDL", raising=False)
    assert pdl_available("cuda") is hopper
    monkeypatch.setenv("CTXCACHE_NO_PDL", "1")
    assert pdl_available("cuda") is False
