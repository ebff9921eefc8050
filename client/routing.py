"""Route a fleet's Generate to a decoder that holds the context hot.

GetContext on any decoder lists `hot_workers`: the members of the registry's Redis set
`ctxcache:v1:hot:<context id>` (host:port as each decoder advertises itself) whose heartbeat is
alive. A client may read that set itself, or use `RoutedClient`: it asks one decoder, streams
Generate from a hot one it knows, and otherwise from the decoder the context id hashes to
(rendezvous hashing), so repeated questions about one context meet on one decoder and it
stays hot there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from ctxcache.client.connection import Client
from ctxcache.client.gen.v1 import context_pb2 as pb


def home(context_id: str, addresses: Sequence[str]) -> str:
    """The address context_id hashes to (rendezvous: removing a decoder moves only its ids)."""
    return max(addresses, key=lambda a: hashlib.sha256(f"{a}\0{context_id}".encode()).digest())


class RoutedClient:
    def __init__(self, addresses: Sequence[str], token: str | None = None, tls_ca: Path | None = None) -> None:
        if not addresses:
            raise ValueError("RoutedClient needs at least one decoder address")
        self.addresses = list(dict.fromkeys(addresses))
        self.clients = {a: Client(a, token, tls_ca) for a in self.addresses}

    def route(self, context_id: str) -> str:
        """A decoder holding context_id hot, else its home decoder."""
        home_address = home(context_id, self.addresses)
        c = self.clients[home_address]
        info = c.context.GetContext(pb.GetContextRequest(context_id=context_id), metadata=c.metadata, timeout=10)
        hot = [w for w in info.hot_workers if w in self.clients]
        return home_address if not hot or home_address in hot else hot[0]

    def put(self, request: pb.PutContextRequest, timeout: float | None = None) -> pb.PutContextResponse:
        """Any decoder enqueues the build; the first is as good as any."""
        return self.clients[self.addresses[0]].put(request, timeout)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.clients[self.route(request.context_id)].generate(request, timeout)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
