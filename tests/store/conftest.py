"""Fixtures for store tests: temp LMDB stores (the private redis-server is tests/conftest.py's
`redis_server`)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"
