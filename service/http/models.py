"""The model names this front answers to: the loaded model's id (what /v1/models lists first and
artifacts record) and the name it was started with (`serve --model`, e.g. the README's
`smollm2`). A request naming any other model is refused (404 model_not_found, as OpenAI and
vLLM answer), never answered by this model under that name."""

from __future__ import annotations

from typing import Any

from ctxcache.errors import NotFound


class ModelNotFound(NotFound):
    """OpenAI's 404 with param "model" and code "model_not_found" (errors.error_body)."""


class ServedModels:
    def __init__(self, model_id: str, aliases: tuple[str, ...], created: int) -> None:
        self.id, self.created = model_id, created
        self.names = tuple(dict.fromkeys((model_id, *aliases)))

    def check(self, name: str) -> str:
        """The name a request asked for -> the name its answer echoes; "" (no model) is the
        served model, as vLLM takes it."""
        if not name:
            return self.id
        if name not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise ModelNotFound(f"the model {name[:80]!r} does not exist on this server; it serves {served}")
        return name

    def card(self, name: str) -> dict[str, Any]:
        self.check(name)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ctxcache",
                **({} if name == self.id else {"root": self.id})}

    def cards(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card(n) for n in self.names]}
