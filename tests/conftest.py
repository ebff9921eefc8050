"""Fixtures shared by every test folder."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2 model, loaded once for the whole run (skips where it is not installed)."""
    from ctxcache.models.loader import load_model
    try:
        return load_model("smollm2")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
