"""Cancellation and a time bound for builds, checked between model layers, method layers and
k-means iterations (no gRPC here: the service sets the token, torch code calls `check()`).

A build runs for seconds to minutes inside torch code that has no cancellation of its own.
A forward pre-hook on every transformer block checks the *building thread's* token (a
thread-local, so decode streams on the same model never see it): a cancelled or overdue
build stops within one block of the prefill (SmolLM2 on 2 CPU cores: ~0.2 s per 1K-token
chunk and block). `CancellableMethod` checks it between the method's layer builds and the
k-means loops call `check()` every iteration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_current = threading.local()


class BuildCancelled(Exception):
    """The build was cancelled (DeleteContext / Evict / shutdown) or ran past its time bound."""


class CancelToken:
    """on_check: called at every check point of a running build (may block: the service hands
    the build's turn to another build there, indexer/build_turns.py)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.blocks = self.layers = 0  # progress: transformer blocks run, method layers built
        self.on_check: Callable[[], None] | None = None

    def cancel(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        self._raise_if_over()
        if self.on_check is not None:
            self.on_check()
            self._raise_if_over()  # cancelled (or overdue) while it waited for its turn

    def _raise_if_over(self) -> None:
        if self._event.is_set():
            raise BuildCancelled(self.reason)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise BuildCancelled(f"the build ran past its time bound of {self.timeout_s:g} s")


def check() -> None:
    """Raise BuildCancelled if this thread is building and its build was cancelled or is overdue."""
    token: CancelToken | None = getattr(_current, "token", None)
    if token is not None:
        token.check()


def _check_current(module: torch.nn.Module, args: Any) -> None:
    token: CancelToken | None = getattr(_current, "token", None)
    if token is not None:
        token.check()
        token.blocks += 1


def install_hooks(model: torch.nn.Module) -> None:
    """Check the building thread's token before every transformer block (idempotent)."""
    if getattr(model, "_ctxcache_cancel_hooks", False):
        return
    for block in model.model.layers:
        block.register_forward_pre_hook(_check_current)
    model._ctxcache_cancel_hooks = True


@contextmanager
def building(token: CancelToken) -> Iterator[None]:
    """Within this block, this thread's forward passes honour `token`."""
    _current.token = token
    try:
        yield
    finally:
        _current.token = None


class CancellableMethod:
    """A SparseMethod whose build_layers checks the token before each layer (delegates the rest)."""

    def __init__(self, method: Any, token: CancelToken) -> None:
        self._method, self._token = method, token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)

    def build_layers(self, layers: Iterable, n_layers: int) -> Iterator:
        def checked() -> Iterator:
            for item in layers:
                self._token.check()
                yield item
        for tables in self._method.build_layers(checked(), n_layers):
            self._token.check()
            self._token.layers += 1
            yield tables
