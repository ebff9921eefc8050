"""A small client for the CLI, the benchmarks and users: channel options, auth and stubs in one place."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from ctxcache.client.gen.v1 import admin_pb2_grpc, context_pb2 as pb, context_pb2_grpc

MAX_MESSAGE = 64 << 20


class Client:
    def __init__(self, address: str, token: str | None = None, tls_ca: Path | None = None,
                 admin_address: str | None = None) -> None:
        opts = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]

        def channel(addr: str) -> grpc.Channel:
            if tls_ca is not None:
                return grpc.secure_channel(addr, grpc.ssl_channel_credentials(tls_ca.read_bytes()), opts)
            return grpc.insecure_channel(addr, opts)

        self.address, self.admin_address = address, admin_address or address
        self.channel = channel(address)
        self.admin_channel = channel(admin_address) if admin_address else self.channel
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.context = context_pb2_grpc.ContextServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.admin_channel)

    def wait_ready(self, timeout: float = 2.0) -> None:
        """Connect every channel or raise ConnectionError naming the address: a refused connection
        fails at once, a host that does not answer after `timeout` s. Without this a call to a
        server that is not running waits out gRPC's reconnect backoff."""
        channels = [(self.channel, self.address)]
        if self.admin_channel is not self.channel:
            channels.append((self.admin_channel, self.admin_address))
        for channel, address in channels:
            _connect(channel, address, timeout)

    def put(self, request: pb.PutContextRequest, timeout: float | None = None) -> pb.PutContextResponse:
        return self.context.PutContext(request, timeout=timeout, metadata=self.metadata)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.context.Generate(request, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()
        if self.admin_channel is not self.channel:
            self.admin_channel.close()


def _connect(channel: grpc.Channel, address: str, timeout: float) -> None:
    states: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()
    seen = states.put  # one bound method, so unsubscribe finds it
    channel.subscribe(seen, try_to_connect=True)
    end = time.monotonic() + timeout
    try:
        while True:
            try:
                state = states.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise ConnectionError(f"no ctxcache server answered at {address} within {timeout:g} s; "
                                      "start one with `ctxcache serve`, or pass --address") from None
            if state is grpc.ChannelConnectivity.READY:
                return
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                raise ConnectionError(f"cannot connect to a ctxcache server at {address} (nothing listens there, "
                                      "or TLS does not match); start one with `ctxcache serve`, or pass --address")
    finally:
        channel.unsubscribe(seen)
