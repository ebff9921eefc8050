"""Built-in evaluation texts, real and available offline.

prose: the GNU GPL v3 text, bundled in quality/corpus/prose.txt (verbatim copying is permitted).
code: Python source from the running interpreter's standard library (argparse, then more
modules as needed), so every Python installation has it.
KINDS: the answer-retention suite's kinds of document, one bundled file each
(quality/corpus/NAME.txt; sources and licenses in quality/corpus/README.md).
WIDE_KINDS: the wide retention suite's number-dense kinds (release notes, changelogs, tables
rendered as text, a log), bundled the same way.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

_TEXT_DIR = Path(__file__).parent / "corpus"  # quality/corpus/ (package data)
_CODE_MODULES = ("argparse", "dataclasses")
KINDS = ("narrative", "license", "changelog", "python", "c", "json")
WIDE_KINDS = ("relnotes", "debchangelog", "services", "zones", "dpkglog")
BUILTIN = ("prose", "code", *KINDS, *WIDE_KINDS)


def builtin_text(name: str) -> str:
    """`prose`, `code`, one of KINDS or WIDE_KINDS, or a path to any UTF-8 text file."""
    if name == "prose" or name in KINDS or name in WIDE_KINDS:
        return (_TEXT_DIR / f"{name}.txt").read_text(encoding="utf-8")
    if name == "code":
        return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in _CODE_MODULES)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--text {name!r} is neither one of {BUILTIN} nor a readable file")
    return path.read_text(encoding="utf-8", errors="replace")


def tokens_of(tokenizer, text: str, n: int, name: str = "text") -> list[int]:
    """The first n tokens of text; ValueError if it is shorter."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise ValueError(f"{name} has {len(ids)} tokens, fewer than the {n} requested")
    return ids[:n]


def text_of_tokens(tokenizer, text: str, n: int) -> str:
    """text repeated and cut to n tokens, decoded back (tokenizer None: one token per byte)."""
    if tokenizer is None:
        data = text.encode("utf-8")
        return (data * (n // max(1, len(data)) + 1))[:n].decode("utf-8", errors="ignore")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode((ids * (n // max(1, len(ids)) + 1))[:n])
