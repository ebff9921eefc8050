"""The offload runner with V held as the artifact's int8 codes in its host slots (offload_v.py)
against the same runner holding V decoded in the model's dtype (the old layout: the oracle): the
same logits bit for bit through a question's prefill and batched steps; the codes are the
artifact's, the positions after a context in the HBM tail; artifacts not held as codes are
refused; the PCIe bytes of a known step. A random fp32 model; on a CPU the kernels run interpreted."""

from dataclasses import replace

import pytest
import torch

from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model
from test_offload_runner import _artifacts

CONFIG = SparseConfig(Budget(0.1, 2, 8))
pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def coded_artifacts(method, lengths, kv_dtype="float32"):
    """Artifacts whose layers hold int8 codes (as the service's builds and the store hand them)."""
    cpu_lm = load_model("random:tiny", seed=3)
    cfg = IndexerConfig(kv_dtype=kv_dtype, progress=False, coded_kv=True)
    return [build_artifact(cpu_lm, torch.randint(0, cpu_lm.args.vocab_size, (n,),
                                                 generator=torch.Generator().manual_seed(n)), method, cfg)
            for n in lengths]


def _run(v_int8, arts, config, steps=3, **kw):
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 2.0})
    r = OffloadRunner(lm, method.params, config, slots=2, max_len=320, max_new=32, v_int8=v_int8, **kw)
    rows, firsts = [], []
    for i, (a, p) in enumerate(zip(arts, ([5, 6, 7], []))):
        row, first = r.admit(f"c{i}", a, p, config, 16)
        rows.append(row)
        firsts.append(first)
    toks = [int(f.argmax()) for f in firsts]
    logits = [torch.stack(firsts)]
    for _ in range(steps):
        logits.append(r.step(rows, toks))
        toks = logits[-1].argmax(-1).tolist()
    return r, rows, logits


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_int8_host_slots_give_the_logits_of_decoded_host_slots_bit_for_bit(kv_dtype):
    """Two streams (a 3-token question, none): the prefill's and three steps' logits equal a bf16-
    layout runner's holding the decoded V; the host codes are the artifact's, and the tail holds
    the positions after each context (the question's and the answer's V, the old layout's there)."""
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 2.0})
    arts = coded_artifacts(method, (200, 150), kv_dtype)
    r8, rows8, got = _run(True, arts, CONFIG)
    r16, rows16, want = _run(False, arts, CONFIG)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert r8.pool.nbytes < 0.6 * r16.pool.nbytes  # page-locked: D bytes a row, not 4 D (fp32 here)
    for row8, row16, art in zip(rows8, rows16, arts):
        n, m = art.n_tokens, row8.length - art.n_tokens
        assert row8.length == row16.length and m > 0
        for layer in range(len(art.layers)):
            parts = art.layers[layer].coded.parts
            assert torch.equal(r8.pool.v_codes[layer][row8.index, :, :n], parts["v"])
            # the scales and the tail are in HBM, the decoded layout's V on the host
            assert torch.equal(r8.pool.v_scales[layer][row8.index, :, :n].cpu(), parts["v_scale"].cpu())
            tail, host = r8.pool.v[layer][row8.index, :, :m], r16.pool.v[layer][row16.index, :, n:n + m]
            assert torch.equal(tail.cpu(), host.cpu())
    assert r8.pool.v_start.tolist() == [a.n_tokens for a in arts]


def test_a_dense_layer_reads_the_codes_too():
    """Layer 1 dense: its decode reads every position (codes, then the tail) by the offload kernel,
    against the old layout's dense kernel: the same greedy tokens, logits within fp32 sums' order."""
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 2.0})
    arts = coded_artifacts(method, (200, 150))
    config = replace(CONFIG, dense_layers=(1,))
    _, _, got = _run(True, arts, config, steps=2)
    _, _, want = _run(False, arts, config, steps=2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist()


def test_artifacts_not_held_as_int8_codes_are_refused_with_the_reason():
    lm = load_model("random:tiny", seed=3)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    exact, coded = _artifacts(method, (100,))[0], coded_artifacts(method, (100,))[0]
    r8 = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=32, v_int8=True)
    r16 = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=32)
    assert not r8.accepts(exact, CONFIG, 8) and "int8 codes" in r8.refusal(exact)
    assert r8.accepts(coded, CONFIG, 8) and r8.refusal(coded) is None
    assert r16.accepts(exact, CONFIG, 8) and r16.accepts(coded, CONFIG, 8)
    with pytest.raises(ValueError, match="int8 codes"):
        r8.admit("x", exact, [], CONFIG, 8)
    r8.release(r8.admit("c", coded, [], CONFIG, 8)[0])
    head = r8.resident_head("c")  # a held context's head (no K/V): its next stream starts from it
    assert head is not None and r8.accepts(head, CONFIG, 8)
    with pytest.raises(ValueError, match="needs K in HBM"):
        OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=256, k_hbm=False, v_int8=True)


def test_pcie_bytes_of_a_known_step_with_int8_v():
    """One slot, a 150-key context, no question, one step (151 keys): static rows on the host are
    the 2 sinks and the recent window's 7 context positions (its 8th, the step's key, is in the
    tail, where the key is written: nothing written back), 16 selected keys a KV head all missed;
    a V row from the host is its 32 codes (the scales are in HBM); 2 layers x 2 KV heads."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    art = coded_artifacts(method, (150,))[0]
    r = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=320, max_new=32, v_int8=True, use_graph=False)
    row, first = r.admit("c", art, [], CONFIG, 8)
    r.step([row], [int(first.argmax())])
    assert r.pcie_bytes() == ((9 + 16) * 32 * 2 * 2, 1)
    assert r.offload_hits() == (0, 16 * 2 * 2)
