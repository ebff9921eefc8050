"""Fixtures for the service tests; the helpers live in service_helpers (a unique module name,
so a full run never confuses them with another folder's conftest)."""

from service_helpers import *  # noqa: F401,F403  (fixtures are found by name here)
