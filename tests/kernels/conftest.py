"""Kernel tests run compiled on a GPU, or through Triton's CPU interpreter without one (the
interpreter and the `device` fixture are set up in tests/conftest.py)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
