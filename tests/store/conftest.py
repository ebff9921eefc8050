"""Fixtures for store tests: temp LMDB stores (the private redis-server is tests/conftest.py's
`redis_server`)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


_TIER_IDS = iter(range(1 << 30))


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def tier_uri(request, tmp_path: Path) -> str:
    """A fresh, empty shared tier: a folder (file://) or a prefix on the module's SeaweedFS (s3://)."""
    if request.param == "file":
        return f"file://{tmp_path / 'shared'}"
    return request.getfixturevalue("s3_module").uri(prefix=f"t{next(_TIER_IDS)}")
