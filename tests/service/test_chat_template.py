"""Issue 43 item 6: a model folder whose tokenizer has no chat template (only tokenizer.json and
tokenizer_config.json) is refused at start with one line naming `--chat-template FILE`, and
serves PutContext and Generate once that flag gives it one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.cli import main as cli
from ctxcache.service.config import ModelConfig
from ctxcache.service.server import create_server

from service_helpers import ask, put_text, tiny_config

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bare_model(smollm2, tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, saved without its chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("bare-model")
    cfg = LlamaConfig(vocab_size=smollm2.tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    smollm2.tokenizer.save_pretrained(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert {p.name for p in folder.glob("tokenizer*")} == {"tokenizer.json", "tokenizer_config.json"}
    return folder


def _lines(err: str) -> list[str]:
    """stderr's lines, less transformers' progress bars (carriage-return redrawn) of the weights' load."""
    return [line for line in err.splitlines() if line and "\r" not in line and "Loading weights" not in line]


def test_serve_without_a_chat_template_is_one_line_naming_the_flag(bare_model, tmp_path, capsys):
    cfg = replace(tiny_config(tmp_path / "data"), model=ModelConfig(str(bare_model)))
    try:
        server = create_server(cfg)[0]
    except ValueError as exc:
        assert "no chat template" in str(exc) and "--chat-template FILE" in str(exc)
    else:  # the old code started, and failed every PutContext with a traceback
        server.stop(0.5)
        pytest.fail("a model without a chat template was served")
    assert cli.main(["serve", "--model", str(bare_model), "--port", "0", "--data", str(tmp_path / "d")]) == 1
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and "--chat-template FILE" in err[0]


def test_chat_template_flag_gives_the_tokenizer_one(bare_model, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    cfg = replace(tiny_config(tmp_path / "data"), model=ModelConfig(str(bare_model), chat_template=template))
    server, port = create_server(cfg)
    from ctxcache.client import Client

    client = Client(f"127.0.0.1:{port}")
    try:
        info = put_text(client, "A lighthouse stands on the Needle. " * 4)
        assert info.state == pb.CONTEXT_STATE_READY and info.n_tokens > 0
        _, final = ask(client, info.context_id, max_tokens=4)
        assert final.usage.generated_tokens == 4 and final.usage.cached_tokens == info.n_tokens
    finally:
        client.close()
        server.stop(0.5)


def test_an_unreadable_chat_template_file_is_one_line(bare_model, tmp_path, capsys):
    assert cli.main(["serve", "--model", str(bare_model), "--port", "0", "--data", str(tmp_path / "d"),
                     "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and "--chat-template" in err[0] and "missing.jinja" in err[0]
