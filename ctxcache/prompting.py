"""How a context and a question become tokens, so that the cached tokens are a true prefix.

The context is rendered with the tokenizer's chat template *without* a generation prompt:
text -> one system message holding the text; documents -> one system message listing them
("Document 1: <title>\n<text>", blank-line separated); chat messages -> as given. A question
is a user turn after those messages. The full conversation is rendered with the generation
prompt; its string must start with the context's rendering (checked, else ValueError), and
only the remainder is tokenized, so prompt = context tokens + suffix tokens exactly. For
ChatML templates (SmolLM2) the boundary is `<|im_end|>\n`, so this equals tokenizing the
whole conversation at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]
ROLES = ("system", "user", "assistant")


def text_messages(text: str) -> Messages:
    return [{"role": "system", "content": text}]


def document_messages(docs: list[tuple[str, str]]) -> Messages:
    """docs: (title or id, text) pairs, in order."""
    parts = [f"Document {i}: {title}\n{text}" if title else f"Document {i}:\n{text}"
             for i, (title, text) in enumerate(docs, 1)]
    return [{"role": "system", "content": "\n\n".join(parts)}]


class ByteTokenizer:
    """For random-weight models (no tokenizer): UTF-8 bytes shifted by 3 (0 bos, 1 eos, 2 pad).

    Used by tests and speed runs only; its template is plain `role: content\\n` lines."""

    eos_token_id = 1
    chat_template = "bytes:role-colon-content-newline"

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Messages, tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


def ensure_chat_template(tokenizer: Any, template: Path | None, model: str) -> None:
    """Give the tokenizer `template`'s text as its chat template, or check that it has one.
    Why at start: every context is rendered with it (module doc), and transformers only finds
    it missing inside apply_chat_template, with a traceback on every PutContext."""
    if template is not None:
        try:
            tokenizer.chat_template = template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {template}: cannot be read ({exc})") from None
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of model {model} has no chat template: pass --chat-template FILE "
                         "(a Jinja template such as the model family's chat_template.jinja)")


def tokenizer_content(t: Any) -> str:
    """Canonical JSON of a tokenizer's behaviour (fast tokenizers: tokenizer.json's parts)."""
    backend = getattr(t, "backend_tokenizer", None)
    if backend is not None:
        j = json.loads(backend.to_str())
        parts = {k: j.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer", "decoder")}
    else:  # slow tokenizers: the vocabulary with added tokens
        parts = {"vocab": sorted(t.get_vocab().items(), key=lambda kv: kv[1])}
    parts["special"] = getattr(t, "special_tokens_map", {})
    return json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Encoders:
    """encode(text, split_special) with no state shared between calls, so concurrent requests
    get the tokens one request alone gets. Why: transformers keeps `split_special_tokens` on the
    one Rust tokenizer (`encode_special_tokens`) and sets it per call, so concurrent calls flipped
    it for each other (forged turns, split template tokens, several ids for one text). A fast
    tokenizer gets two Rust copies, one per setting, never changed after this; others a lock."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._rust = None if backend is None else {split: _frozen_copy(backend, split) for split in (False, True)}
        self._lock = threading.Lock()

    def encode(self, text: str, split_special: bool) -> list[int]:
        if self._rust is not None:
            return self._rust[split_special].encode(text, add_special_tokens=False).ids
        with self._lock:  # slow tokenizers and ByteTokenizer: one call at a time
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special))


def _frozen_copy(backend: Any, split_special: bool) -> Any:
    """The backend as transformers runs it for encode(): no truncation or padding."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(backend.to_str())
    t.no_truncation()
    t.no_padding()
    t.encode_special_tokens = split_special
    return t


@dataclass
class Prompter:
    tokenizer: Any
    _encoders: Encoders = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._encoders = Encoders(self.tokenizer)

    @property
    def template_id(self) -> str:
        """Identity of the chat template (part of the context id)."""
        template = getattr(self.tokenizer, "chat_template", None) or "none"
        return hashlib.sha256(str(template).encode()).hexdigest()[:16]

    @functools.cached_property
    def tokenizer_id(self) -> str:
        """Identity of the tokenizer (part of the context id): a hash of what it does (vocab,
        merges, added and special tokens, normalizer, pre-tokenizer), never where it was loaded
        from, so the same text gets the same id from any cache directory, venv or host."""
        t = self.tokenizer
        if isinstance(t, ByteTokenizer):
            return "bytes-v1"
        return hashlib.sha256(tokenizer_content(t).encode()).hexdigest()[:16]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return () if eos is None else (int(eos),)

    @functools.cached_property
    def message_tokens(self) -> int:
        """The fewest template tokens one more chat message adds (its role header and end marks,
        content aside): with one token of content at least, what a size pre-check charges each
        message before anything is tokenized."""
        def template_tokens(roles: list[str]) -> int:
            marked, _ = _mark([{"role": r, "content": ""} for r in roles])
            return len(self._encode_rendered(self.render(marked, add_generation_prompt=False), [""] * len(roles)))

        added = []
        for role in ROLES:
            for before in (["system"], ["system", role]):
                try:
                    added.append(template_tokens(before + [role]) - template_tokens(before))
                except Exception:  # noqa: BLE001 - a template may refuse an order (jinja raise_exception)
                    continue
        return max(0, min(added, default=0))

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Template text: its control tokens (<|im_start|> ...) are real control tokens."""
        return self._encoders.encode(text, split_special=False)

    def encode_user(self, text: str) -> list[int]:
        """Caller text: a control-token string in it is plain text, so no one forges a turn."""
        return self._encoders.encode(text, split_special=True)

    def _encode_rendered(self, rendered: str, contents: list[str]) -> list[int]:
        """Tokens of a rendering whose message contents are sentinels: template pieces with
        their control tokens, contents (sentinel i -> contents[i]) with theirs split."""
        out: list[int] = []
        for i, piece in enumerate(_SENTINEL.split(rendered)):
            if i % 2 == 0:
                out += self.encode(piece) if piece else []
            else:
                out += self.encode_user(contents[int(piece)])
        return out

    def context_tokens(self, messages: Messages) -> list[int]:
        return self.prompt_tokens(messages, add_generation_prompt=False)

    def prompt_tokens(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        """A whole conversation's tokens, as a server with no cache prefills them."""
        marked, contents = _mark(messages)
        return self._encode_rendered(self.render(marked, add_generation_prompt=add_generation_prompt), contents)

    def turn_tokens(self, context: Messages, turn: Messages) -> list[int]:
        """Tokens to append after the cached context for a new turn (ends with the assistant prompt)."""
        marked, contents = _mark(context + turn)
        head = self.render(marked[:len(context)], add_generation_prompt=False)
        full = self.render(marked, add_generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("the chat template does not render the context as a prefix of the conversation")
        return self._encode_rendered(full[len(head):], contents)


# Message contents are rendered as these markers (private-use characters no template emits),
# then tokenized apart from the template; the pattern's group is the content's index.
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def _mark(messages: Messages) -> tuple[Messages, list[str]]:
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    return marked, [m["content"] for m in messages]
