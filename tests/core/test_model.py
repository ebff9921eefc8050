"""Our Transformer against the Hugging Face reference implementation, and the decode loop."""

import pytest
import torch

from ctxcache.generation import SamplingParams, decode_n_tokens, decode_one_token, prefill, sample
from ctxcache.models.attention import dense_attention
from ctxcache.models.loader import args_from_hf_config
from ctxcache.models.llama import Transformer


def _hf_pair(model_type: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if model_type == "llama":
        cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=256, rope_theta=5000.0)
    else:
        cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=256, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ours = Transformer(args_from_hf_config(cfg)).eval()
    ours.load_state_dict(hf.state_dict(), strict=False)
    return hf, ours


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_logits_match_hugging_face(model_type):
    hf, ours = _hf_pair(model_type)
    x = torch.randint(0, 300, (1, 37))
    with torch.no_grad():
        ref = hf(x).logits[0]
        got = ours(x, torch.arange(37)[None], ours.new_cache(1, 64), dense_attention)[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_then_decode_equals_one_pass():
    _, model = _hf_pair("llama")
    x = torch.randint(0, 300, (1, 50))
    with torch.no_grad():
        full = model(x, torch.arange(50)[None], model.new_cache(1, 64), dense_attention)[0]
    cache = model.new_cache(1, 64)
    last = prefill(model, x[:, :45], cache, dense_attention, chunk=16)
    torch.testing.assert_close(last[0], full[44], atol=1e-4, rtol=1e-4)
    for t in range(45, 50):  # teacher-forced single steps reproduce the one-pass logits
        step = decode_one_token(model, x[:, t], cache, dense_attention)
        torch.testing.assert_close(step[0], full[t], atol=1e-4, rtol=1e-4)
    assert cache.lengths.item() == 50


def test_generation_stops_at_stop_token_and_cache_end():
    _, model = _hf_pair("llama")
    cache = model.new_cache(1, 12)
    last = prefill(model, torch.randint(0, 300, (1, 10)), cache, dense_attention)
    first = int(last.argmax())
    steps = list(decode_n_tokens(model, last, cache, dense_attention,
                                 SamplingParams(max_tokens=5, stop_token_ids=(first,))))
    assert len(steps) == 1 and bool(steps[0][1][0])
    steps = list(decode_n_tokens(model, last, cache, dense_attention, SamplingParams(max_tokens=50)))
    assert len(steps) == 3 and bool(steps[-1][1][0])  # 10 + 2 decoded fill the 12 slots


def test_sampling_rules():
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0]])
    assert sample(logits, SamplingParams(), None).item() == 1
    gen = torch.Generator().manual_seed(0)
    picks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen).item() for _ in range(50)}
    assert picks == {1}  # top-p 0.5 keeps only the dominant token
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_positions_past_cache_are_refused():
    _, model = _hf_pair("llama")
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[64]]), model.new_cache(1, 64),
              dense_attention)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_checkpoint_by_local_path_runs_on_the_test_device(tmp_path, model_type, device):
    """`load_model(PATH, device=...)`: a saved Hugging Face checkpoint (weights + tokenizer)
    decodes on the device (the GPU on the GPU machine) with the reference's logits."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ctxcache.models.loader import load_model

    hf, _ = _hf_pair(model_type)
    hf.save_pretrained(tmp_path)
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(299)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device=device)
    assert lm.tokenizer is not None and lm.model_id == str(tmp_path)
    ids = [6, 18, 4, 251, 10]
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(x).logits[0]
        got = lm.model(x.to(device), torch.arange(len(ids), device=device)[None], lm.model.new_cache(1, 16),
                       dense_attention)[0]
    torch.testing.assert_close(got.cpu(), ref, atol=2e-4, rtol=2e-4)


def test_random_models_take_the_bundled_tokenizer_where_their_vocabulary_holds_it(smollm2):
    from ctxcache.models.loader import load_model

    assert load_model("random:tiny").tokenizer is None  # 512 ids: one token per byte
    lm = load_model("random:smollm2-135m")
    assert lm.model_id.startswith("random:") and lm.tokenizer is not None
    assert lm.tokenizer.encode("the keeper", add_special_tokens=False) == \
        smollm2.tokenizer.encode("the keeper", add_special_tokens=False)


def test_the_fused_weights_save_and_load_under_the_checkpoint_names():
    """qkv_proj and gate_up_proj are one weight each inside the model; a state dict holds q/k/v_proj
    and gate/up_proj as checkpoints do, and loads back strictly (bias included: Qwen2 has one)."""
    _, model = _hf_pair("qwen2")
    state = model.state_dict()
    names = {k for k in state if ".self_attn." in k and k.startswith("model.layers.0.")}
    assert names == {f"model.layers.0.self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")} | {
        "model.layers.0.self_attn.o_proj.weight"}
    mlp = {k for k in state if k.startswith("model.layers.0.mlp.")}  # gate and up: one weight inside too
    assert mlp == {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    again = Transformer(model.args).eval()
    again.load_state_dict(state, strict=True)
    for mine, theirs in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(mine, theirs)
