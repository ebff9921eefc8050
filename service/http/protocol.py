"""Request bodies of the HTTP front (pydantic), in OpenAI's shape for chat and completions and
Gemini's for the cache resource. Shapes and types only: ranges, sizes and identities are
checked once, by the same code the gRPC front uses (convert.py), so both fronts refuse the same
values with the same words. Unknown fields are accepted and ignored, as OpenAI's own server
does with fields a client library adds."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_U32 = 2**32 - 1


def _utf8(value: str) -> str:
    """JSON may carry lone surrogates (\\ud800); they are not text any tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid UTF-8 text ({exc.reason} at position {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
_DURATION = re.compile(r"(\d{1,10})(?:\.\d+)?s")


def _seconds(value: int | str | None) -> int | None:
    """A TTL as Gemini writes it ("3600s") or a number of seconds; 0 or None: no expiry."""
    if isinstance(value, str):
        m = _DURATION.fullmatch(value.strip())
        if m is None:
            raise ValueError(f"{value[:40]!r} is not a duration such as '3600s'")
        value = int(m[1])
    if value is not None and not 0 <= value <= MAX_U32:
        raise ValueError(f"{value} seconds must be in [0, {MAX_U32}]")
    return value or None


# -> whole seconds, or None for no expiry
Duration = Annotated[int | Text | None, AfterValidator(_seconds)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value):
        """Content parts: text only (images, audio and files have no place in a text model)."""
        if isinstance(value, str):
            return value
        texts = []
        for i, part in enumerate(value):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: only {{'type': 'text', 'text': ...}} parts are supported")
            texts.append(_utf8(part["text"]))
        return "".join(texts)

    def plain(self) -> dict[str, str]:
        """-> {role, content} as the prompter renders it (OpenAI's "developer" is the system role)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": str(self.content)}


class StreamOptions(_Body):
    include_usage: bool = False


Stop = Text | list[Text] | None


class SamplingBody(_Body):
    """What chat and text completions share."""
    model: Text = ""  # checked against the served names (models.py)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_U32)] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM's sampling extras: refused unless neutral (the sampler has temperature and top_p only)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # ctxcache's own: the cached context to continue (an id, or "cachedContents/<id>"), a sparse
    # schedule for this request, and the answer's token ids in each choice (as vLLM's option)
    cached_content: Text | None = None
    schedule: Text | None = None
    return_token_ids: bool = False

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_U32)] | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingBody):
    prompt: Text | list[Text]
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, str):
            return value
        if len(value) != 1:
            raise ValueError(f"a list of {len(value)} prompts; one prompt per request is supported")
        return value[0]


class Document(_Body):
    text: Text
    title: Text = ""
    id: Text = ""


class MethodBody(_Body):
    name: Text = ""
    params: dict[str, Any] = Field(default_factory=dict)


class CachedContentCreate(_Body):
    """One of text, messages, documents; the rest as PutContext takes it."""
    model: Text = ""
    text: Text | None = None
    messages: list[ChatMessage] | None = None
    documents: list[Document] | None = None
    ttl: Duration = None  # seconds; None: no expiry
    labels: dict[Text, Text] = Field(default_factory=dict)
    method: Text | MethodBody | None = None
    codec: Text = ""
    pin: bool = False
    wait: bool = False  # true: answer once READY or FAILED
    tenant: Text = ""
    keep_queries: bool = False


class CachedContentUpdate(_Body):
    ttl: Duration = None  # "0s" or null: no expiry


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt (tokenized as /v1/completions takes it) or chat messages
    (rendered with the chat template, as /v1/chat/completions prefills them)."""
    model: Text = ""
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: Text = ""
    tokens: list[Annotated[int, Field(ge=0)]]
