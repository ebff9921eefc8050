"""Everyday CLI mistakes described in words (cli.main prints them as one line)."""

from __future__ import annotations

import json

import grpc


def describe(exc: BaseException) -> str:
    """A message that names what to fix, for the errors users meet; else type and message."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {exc.filename}"
    if isinstance(exc, IsADirectoryError):
        return f"{exc.filename} is a directory, not a file"
    if isinstance(exc, PermissionError):
        return f"permission denied: {exc.filename}"
    if isinstance(exc, UnicodeDecodeError):
        return f"the file is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    if type(exc).__name__ == "ArrowInvalid":
        return f"not a Parquet or Arrow file: {exc}"
    return f"{exc}" if isinstance(exc, (ValueError, OSError, RuntimeError)) else f"{type(exc).__name__}: {exc}"
