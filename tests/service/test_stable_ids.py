"""Issue 22 #3: context ids do not depend on where the tokenizer was loaded from."""

from __future__ import annotations

from transformers import AutoTokenizer

from ctxcache.artifact import FORMAT_VERSION
from ctxcache.service.demo_text import TEXT
from ctxcache.prompting import Prompter, text_messages
from ctxcache.store import context_id_for


def _context_id(p: Prompter, model_id: str) -> str:
    tokens = p.context_tokens(text_messages(TEXT))
    return context_id_for(model_id, p.tokenizer_id, p.template_id, "float16", FORMAT_VERSION,
                          "csattention", {}, tokens)


def test_same_text_same_id_from_two_model_cache_directories(smollm2, tmp_path):
    loaded = []
    for name in ("cache-a", "elsewhere/cache-b"):
        smollm2.tokenizer.save_pretrained(str(tmp_path / name))
        loaded.append(AutoTokenizer.from_pretrained(str(tmp_path / name)))
    assert len({t.name_or_path for t in (smollm2.tokenizer, *loaded)}) == 3  # three locations
    ids = {_context_id(Prompter(t), smollm2.model_id) for t in (smollm2.tokenizer, *loaded)}
    assert len(ids) == 1, ids


def test_smollm2_tokenizer_identity_is_pinned(smollm2):
    # the hash of the tokenizer's content: the same on every host and venv with this tokenizer
    assert Prompter(smollm2.tokenizer).tokenizer_id == "d74e4ae96a5a2177"
