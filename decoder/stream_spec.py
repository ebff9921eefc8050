"""What a Generate asks (GenerateSpec) and what its stream yields (Chunk, then one Final), in
no protocol's terms: the gRPC and HTTP fronts translate them (service/convert.py, http/shapes.py)
and GenerateStreams (generate_streams.py) serves them."""

from __future__ import annotations

from dataclasses import dataclass

from ctxcache.generation import SamplingParams
from ctxcache.prompting import Messages


@dataclass(frozen=True)
class GenerateSpec:
    context_id: str
    turn: Messages
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    schedule: str = ""
    # raw tokens that follow the context instead of the rendered turn (a text completion)
    prompt_tokens: tuple[int, ...] = ()
    # True: a max_tokens past the model's window is refused before decoding (OpenAI's answer),
    # not cut to the room left (gRPC's, which then finishes with context_limit)
    strict_window: bool = False


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Final:
    text: str
    finish_reason: str  # stop | stop_sequence | length | context_limit
    cached_tokens: int
    new_prompt_tokens: int
    generated_tokens: int
    ttft_seconds: float
    tokens_per_second: float
    load_seconds: float
    total_seconds: float
    cache_hit: bool
    decode_path: str  # the runner that decoded the stream
