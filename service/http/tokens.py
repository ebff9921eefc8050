"""vLLM's /tokenize and /detokenize, and /version: what a client needs to count a prompt's
tokens against the window before it sends it. Knows no web framework."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ctxcache import __version__
from ctxcache.errors import InvalidArgument
from ctxcache.service.http.models import ServedModels
from ctxcache.service.http.protocol import DetokenizeRequest, TokenizeRequest
from ctxcache.prompting import Prompter
from ctxcache.service.rpc.calls import in_thread


class Tokens:
    def __init__(self, prompter: Prompter, pool: ThreadPoolExecutor, models: ServedModels, max_len: int,
                 vocab_size: int) -> None:
        self.prompter, self.pool, self.models = prompter, pool, models
        self.max_len, self.vocab_size = max_len, vocab_size

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.models.check(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidArgument("prompt", "set one of prompt or messages")
        if req.prompt is not None:
            tokens = await in_thread(self.pool, self.prompter.encode, req.prompt)
        else:
            messages = [m.plain() for m in req.messages or ()]
            tokens = await in_thread(self.pool, self.prompter.prompt_tokens, messages, req.add_generation_prompt)
        strs = None
        if req.return_token_strs:
            tok = self.prompter.tokenizer
            strs = tok.convert_ids_to_tokens(tokens) if hasattr(tok, "convert_ids_to_tokens") else [
                tok.decode([t]) for t in tokens]
        return {"count": len(tokens), "max_model_len": self.max_len, "tokens": tokens, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.models.check(req.model)
        for i, t in enumerate(req.tokens):
            if t >= self.vocab_size:
                raise InvalidArgument(f"tokens[{i}]", f"{t} is not a token id (the vocabulary has {self.vocab_size})")
        text = await in_thread(self.pool, self.prompter.tokenizer.decode, req.tokens)
        return {"prompt": text}

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": __version__}
