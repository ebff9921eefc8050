"""Kernel tests run compiled on a GPU, or through Triton's CPU interpreter without one (the
interpreter and the `device` fixture are set up in tests/conftest.py)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture
def small_score_pad(monkeypatch):
    """Interpreted on a CPU, score rows padded to 1024 keys, not the selector's 8192: the runner
    tests' contexts hold a few hundred keys, and the interpreter runs the score and radix
    kernels' all-padding blocks as slowly as real ones (8x their cost at these shapes). Top-K
    over several blocks is the kernel tests' (test_select_kernels, test_topk_pair) to check."""
    if not torch.cuda.is_available():
        from ctxcache.decoder.gpu import selector
        monkeypatch.setattr(selector, "PAD", 1024)
